"""HuggingFace-style directories (config.json + safetensors + tokenizer): llama and qwen2 (q/k/v biases, untied
LM head) against transformers on the same random weights, and the CLI end to end."""

import subprocess
import sys

import pytest
import torch

from pagedllm import LLM, SamplingParams


def _tiny(tmp_path, llm, kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=llm.engine.core.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random biases, so that a missing bias would show
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():  # larger weights: confident, non-tied greedy choices
            p.mul_(8.0) if p.dim() > 1 else None
    d = tmp_path / kind
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    return model.eval(), str(d)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_directory_matches_transformers(tmp_path, llm, kind):
    ref, path = _tiny(tmp_path, llm, kind)
    ours = LLM(model=path, max_model_len=512)
    assert ours.engine.core.runner.arch.arch == kind
    prompts = [[5, 17, 300, 42, 9], [1000, 2000, 3000], list(range(100, 140))]
    outs = ours.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1),
                         use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.inference_mode():
            full = ref.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                                pad_token_id=0, eos_token_id=None)
            logits = ref(full).logits[0].float()
        want = full[0, len(p):].tolist()
        got = o.outputs[0].token_ids
        assert got == want, (kind, p)
        ref_lp = torch.log_softmax(logits[len(p) - 1 : -1], dim=-1)
        for i, lp in enumerate(o.outputs[0].logprobs):
            assert abs(lp.logprob - ref_lp[i, got[i]].item()) < 1e-3


def test_cli_generate_and_chat():
    r = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "generate", "The capital of France is",
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is") and "Paris" in r.stdout
    r = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "chat", "--max-tokens", "30"],
                       input="What is 2+2?\n/exit\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout


def test_cli_generate_file_json(tmp_path):
    import json

    f = tmp_path / "prompts.txt"
    f.write_text("The capital of France is\nQ: What is 17 multiplied by 3?\\nA:\n")
    r = subprocess.run([sys.executable, "-m", "pagedllm.cli.main", "generate", "--file", str(f), "--json",
                        "--max-tokens", "6"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == ["The capital of France is", "Q: What is 17 multiplied by 3?\nA:"]
    assert all(len(row["token_ids"]) == 6 and row["finish_reason"] == "length" for row in rows)
    assert "Generating" in r.stderr  # the progress bar
