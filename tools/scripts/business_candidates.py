"""Candidate items for pagedllm/eval/data/business.jsonl.

`python3 tools/scripts/business_candidates.py > /tmp/cands.jsonl` writes every candidate; `pagedllm eval --select-from
/tmp/cands.jsonl --write pagedllm/eval/data/business.jsonl` keeps those the full-precision default model answers
correctly (the issue asks for a set the model passes unquantized, so that drops measure quantization damage)."""

import json

items = []


def add(cat, prompt, *answers):
    items.append({"category": cat, "prompt": prompt, "answers": list(answers)})


capitals = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Germany": "Berlin", "Spain": "Madrid",
            "the United Kingdom": "London", "Russia": "Moscow", "China": "Beijing", "Egypt": "Cairo",
            "Canada": "Ottawa", "Australia": "Canberra", "India": "New Delhi", "Greece": "Athens",
            "Portugal": "Lisbon", "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm",
            "Austria": "Vienna", "Poland": "Warsaw", "Thailand": "Bangkok", "South Korea": "Seoul",
            "Kenya": "Nairobi", "Argentina": "Buenos Aires", "Mexico": "Mexico City", "Peru": "Lima",
            "Cuba": "Havana", "Turkey": "Ankara", "Finland": "Helsinki", "Denmark": "Copenhagen",
            "Belgium": "Brussels", "the Netherlands": "Amsterdam", "Hungary": "Budapest", "Brazil": "Brasilia",
            "Chile": "Santiago", "Vietnam": "Hanoi", "Iran": "Tehran", "Iraq": "Baghdad", "Switzerland": "Bern",
            "the Philippines": "Manila", "Indonesia": "Jakarta"}
for c, cap in capitals.items():
    add("geography", f"What is the capital of {c}? Answer with one word.", cap)
for a, b in [(2, 3), (4, 5), (7, 8), (10, 15), (12, 9), (20, 30), (6, 7), (3, 3), (9, 9), (11, 11), (25, 25),
             (100, 200), (15, 5), (8, 6), (50, 50)]:
    add("arithmetic", f"What is {a} plus {b}? Answer with a number.", str(a + b))
for a, b in [(2, 3), (4, 5), (3, 3), (5, 5), (10, 10), (6, 2), (7, 2), (9, 3), (8, 2), (12, 2)]:
    add("arithmetic", f"What is {a} times {b}? Answer with a number.", str(a * b))
for q, a in [("How many days are in a week?", "7|seven"), ("How many hours are in a day?", "24"),
             ("How many minutes are in an hour?", "60|sixty"), ("How many months are in a year?", "12|twelve"),
             ("How many seconds are in a minute?", "60|sixty"), ("How many days are in a year?", "365"),
             ("How many legs does a spider have?", "8|eight"), ("How many legs does a dog have?", "4|four"),
             ("How many sides does a triangle have?", "3|three"), ("How many sides does a square have?", "4|four"),
             ("How many continents are there?", "7|seven"), ("How many centimeters are in a meter?", "100"),
             ("How many grams are in a kilogram?", "1000|1,000"), ("How many cents are in a dollar?", "100"),
             ("How many players are on a soccer team on the field?", "11|eleven"),
             ("How many weeks are in a year?", "52"), ("How many letters are in the English alphabet?", "26")]:
    add("units", q, *a.split("|"))
for w, o in [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
             ("light", "dark"), ("open", "closed|close"), ("good", "bad"), ("day", "night"), ("old", "new|young"),
             ("high", "low"), ("rich", "poor"), ("early", "late"), ("full", "empty"), ("wet", "dry"),
             ("strong", "weak"), ("left", "right"), ("win", "lose"), ("buy", "sell"), ("push", "pull")]:
    add("language", f"What is the opposite of '{w}'? Answer with one word.", *o.split("|"))
for s, a in [("sky on a clear day", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"),
             ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange")]:
    add("knowledge", f"What color is {s}? Answer with one word.", a)
for q, a in [("Who wrote 'Romeo and Juliet'?", "Shakespeare"), ("What planet do we live on?", "Earth"),
             ("What is the largest planet in our solar system?", "Jupiter"),
             ("What is the closest star to Earth?", "Sun"), ("What gas do plants absorb from the air?",
                                                               "carbon dioxide|CO2"),
             ("What is the chemical symbol for water?", "H2O"), ("What is the freezing point of water in Celsius?",
                                                                  "0|zero"),
             ("What is the boiling point of water in Celsius?", "100"), ("What is the largest ocean on Earth?",
                                                                         "Pacific"),
             ("Who painted the Mona Lisa?", "Leonardo|da Vinci"), ("What is the tallest mountain in the world?",
                                                                    "Everest"),
             ("Which animal is known as the king of the jungle?", "lion"), ("What do bees make?", "honey"),
             ("What is the longest river in Africa?", "Nile"), ("What language is spoken in Brazil?", "Portuguese"),
             ("What currency is used in Japan?", "yen"), ("What currency is used in the United Kingdom?",
                                                         "pound"),
             ("What currency is used in the United States?", "dollar"), ("In which country are the pyramids of Giza?",
                                                                         "Egypt"),
             ("What is the first month of the year?", "January"), ("What is the last month of the year?", "December"),
             ("What day comes after Monday?", "Tuesday"), ("What day comes after Friday?", "Saturday"),
             ("What day comes before Sunday?", "Saturday"), ("What season comes after winter?", "spring"),
             ("What is frozen water called?", "ice"), ("What is the opposite of north?", "south"),
             ("What animal says 'moo'?", "cow"), ("What animal says 'meow'?", "cat"),
             ("What is the main ingredient of bread?", "flour|wheat"),
             ("What organ pumps blood through the body?", "heart"), ("How many wheels does a bicycle have?",
                                                                     "2|two")]:
    add("knowledge", q, *a.split("|"))
for q, a in [("What does CEO stand for?", "Chief Executive Officer"), ("What does HR stand for?", "Human Resources"),
             ("What does CFO stand for?", "Chief Financial Officer"), ("What does FAQ stand for?",
                                                                      "Frequently Asked Questions"),
             ("What does ROI stand for in business?", "Return on Investment"),
             ("What does B2B stand for?", "Business to Business|Business-to-Business"),
             ("What does CTO stand for?", "Chief Technology Officer"),
             ("What does KPI stand for?", "Key Performance Indicator"),
             ("What does GDP stand for?", "Gross Domestic Product"),
             ("What does ASAP stand for?", "As Soon As Possible"),
             ("What does PDF stand for?", "Portable Document Format"),
             ("What does USB stand for?", "Universal Serial Bus"),
             ("What does CPU stand for?", "Central Processing Unit"),
             ("What does AI stand for?", "Artificial Intelligence"),
             ("What does VIP stand for?", "Very Important Person"),
             ("What does DIY stand for?", "Do It Yourself"),
             ("What does a company's revenue minus its costs equal?", "profit"),
             ("What is a document that requests payment from a customer called?", "invoice"),
             ("What is the money a bank pays you for keeping savings called?", "interest"),
             ("What do you call a person who buys goods or services from a business?", "customer|consumer|client")]:
    add("business", q, *a.split("|"))
reviews = [("The product arrived broken and support never answered my emails.", "negative"),
           ("Absolutely love it, works perfectly and shipping was fast!", "positive"),
           ("Terrible quality, I want a refund.", "negative"),
           ("Great service, the staff were friendly and helpful.", "positive"),
           ("This is the worst purchase I have ever made.", "negative"),
           ("Excellent value for money, I would buy it again.", "positive"),
           ("The package was late and the item was damaged.", "negative"),
           ("Fantastic experience, highly recommended!", "positive"),
           ("I am very disappointed, it stopped working after a day.", "negative"),
           ("Five stars, exactly what I needed.", "positive")]
for r, a in reviews:
    add("business", f"Is this customer review positive or negative? Review: \"{r}\" Answer with one word.", a)
for w, p in [("cat", "cats"), ("child", "children"), ("mouse", "mice"), ("box", "boxes"), ("foot", "feet"),
             ("man", "men"), ("tooth", "teeth"), ("city", "cities")]:
    add("language", f"What is the plural of '{w}'? Answer with one word.", p)
for i, it in enumerate(items):
    it["id"] = f"b{i:03d}"
    print(json.dumps(it))
