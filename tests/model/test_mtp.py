"""Qwen 3.5's multi-token prediction (MTP) layer as the speculative proposer (``--speculative-config
'{"method": "mtp", ...}'``). transformers loads Qwen 3.5 without its ``mtp.*`` tensors, so the reference here is
the module written out with transformers' own layers (its decoder layer, RMSNorm and rotary): every draft the
engine proposes — after prompts in chunks, verify steps that reject drafts, preemptions and prefix-cache hits —
must be the reference's for that request's tokens at that moment, and the greedy tokens those of the model
alone. Tiny random Qwen 3.5 models from transformers' configs, with a random MTP module saved beside each."""

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from test_qwen3_5 import _hf_model

K = 2  # drafts a step: the first from the target's hidden state, the second from the module's own output
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# token ids (no 0: the reference reads it as padding); the last shares the first's 48-token prefix
PROMPTS = [[(i * 37) % 5000 + 100 for i in range(24)] * 2 + [5, 6, 7], [7, 8, 9, 10, 11] * 6,
           [(i * 91) % 3000 + 50 for i in range(40)], [(i * 37) % 5000 + 100 for i in range(24)] * 2 + [9]]


class Reference:
    """The MTP module over transformers' layers: at position p, fc([norm_e(embed(t[p+1])), norm_h(h[p])]), then a
    full-attention decoder layer and a final norm; the model's head gives t[p+2]."""

    def __init__(self, model) -> None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

        cfg = model.config
        hid = cfg.hidden_size
        torch.manual_seed(1)
        self.model = model
        self.layer = type(model.model.layers[3])(cfg, cfg.layer_types.index("full_attention")).eval()
        self.norm_e, self.norm_h, self.norm = (Qwen3_5RMSNorm(hid, eps=cfg.rms_norm_eps) for _ in range(3))
        self.fc = torch.nn.Linear(2 * hid, hid, bias=False)
        with torch.no_grad():  # as the model's: larger weights, norms not all 1
            for p in self.layer.parameters():  # (a layer built alone is not initialised by the model: the MoE's
                p.normal_(0.0, cfg.initializer_range) if p.dim() > 1 else p.zero_()  # stacked experts were garbage)
            for p in [*self.layer.parameters(), *self.fc.parameters(), *(n.weight for n in self.norms())]:
                p.mul_(8.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
        self.layer.self_attn.config._attn_implementation = "eager"

    def norms(self):
        return self.norm_e, self.norm_h, self.norm

    def tensors(self) -> dict[str, torch.Tensor]:
        """Named as Qwen 3.5 checkpoints name them."""
        out = {f"mtp.layers.0.{k}": v for k, v in self.layer.state_dict().items()}
        out |= {"mtp.fc.weight": self.fc.weight, "mtp.pre_fc_norm_embedding.weight": self.norm_e.weight,
                "mtp.pre_fc_norm_hidden.weight": self.norm_h.weight, "mtp.norm.weight": self.norm.weight}
        return {k: v.detach().contiguous() for k, v in out.items()}

    @torch.no_grad()
    def _module(self, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = self.fc(torch.cat([self.norm_e(m.model.embed_tokens(torch.tensor([next_ids]))), self.norm_h(hidden)], -1))
        t = x.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.layer(x, position_embeddings=m.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
        return self.norm(out)

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k drafts after ``tokens`` (the last one just sampled, not yet computed by the model)."""
        m = self.model
        hidden = m.model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state  # (1, L-1, H), final-normed
        nxt, out = list(tokens[1:]), []
        for _ in range(k):
            o = self._module(nxt, hidden)
            out.append(int(m.lm_head(o[0, -1]).argmax()))
            hidden = torch.cat([hidden, o[:, -1:]], dim=1)  # its own output stands in for the next hidden state
            nxt.append(out[-1])
        return out


@pytest.fixture(scope="module", params=["dense", "moe"])
def mtp_model(request, tmp_path_factory, llm):
    """(HF directory with the MTP tensors, the reference, each prompt's greedy tokens from the model alone); Qwen
    3.5, and Qwen 3.5 MoE (its MTP layer a mixture of experts too)."""
    d = tmp_path_factory.mktemp("qwen35_mtp")
    model = _hf_model(llm.engine.core.vocab_size, moe=request.param == "moe")
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    ref = Reference(model)
    save_file(ref.tensors(), str(d / "mtp.safetensors"))  # (the checkpoints' index lists them with the rest)
    alone = LLM(model=str(d), dtype="float32", max_model_len=256)
    want = [o.outputs[0].token_ids for o in alone.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return str(d), ref, want


def _record(llm, oracle: dict | None = None) -> list[tuple[list[int], list[int]]]:
    """Every proposal from here on: (the request's tokens then, its drafts). ``oracle`` (prompt -> the greedy
    continuation): the drafts verified are the continuation instead, one of them made wrong at a position that
    cycles through 0, 1, and none, so that verify steps accept none, some and all of them (the module's own drafts
    are still recorded)."""
    prop = llm.engine.core.runner.proposer
    inner, seen = prop._propose_mtp, []

    def wrapped(budget, requests, tables):
        res = inner(budget, requests, tables)
        for rid, drafts in res.items():
            st = requests[rid]
            seen.append((st.prompt_token_ids + st.output_token_ids, drafts))
            if oracle is not None:
                n = len(st.output_token_ids)
                res[rid] = list(oracle[tuple(st.prompt_token_ids)][n : n + len(drafts)])
                if (wrong := len(seen) % (K + 1)) < len(res[rid]):
                    res[rid][wrong] = res[rid][wrong] % 40000 + 1
        return res

    prop._propose_mtp = wrapped
    return seen


def _check(llm, ref, want, seen, passes: int = 1):
    for _ in range(passes):
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    wrong = [(toks, got, ref.drafts(toks, len(got))) for toks, got in seen if got != ref.drafts(toks, len(got))]
    assert len(seen) > 40 and not wrong, wrong[:3]
    return llm.engine.core.stats()


def test_every_draft_is_the_reference_modules(mtp_model):
    """Batched, prompts in 32-token steps, a KV pool small enough to preempt, then the same prompts again (their
    prefixes cached, one block short: an MTP layer's K/V at a block's last position read the next block's first
    token): each proposal is the reference's for the request's tokens at that moment."""
    d, ref, want = mtp_model
    llm = LLM(model=d, dtype="float32", max_model_len=128, max_num_batched_tokens=32, num_gpu_blocks_override=14,
              speculative_config={"method": "mtp", "num_speculative_tokens": K})
    st = _check(llm, ref, want, _record(llm), passes=2)
    assert st.spec_num_drafts > 40 and st.prefix_cache_hits > 0 and st.num_preemptions > 0


def test_drafts_after_accepted_ones_are_the_reference_modules(mtp_model):
    """Verify steps that accept none, one or both drafts (the oracle's): the module's rows after the accepted
    tokens, its first draft from the last accepted row, stay the reference's."""
    d, ref, want = mtp_model
    llm = LLM(model=d, dtype="float32", max_model_len=256,
              speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": K})  # (vLLM's spelling)
    st = _check(llm, ref, want, _record(llm, {tuple(p): w for p, w in zip(PROMPTS, want)}))
    by_pos = st.spec_accepted_per_pos
    assert by_pos[0] > by_pos[1] > 0


def test_a_model_without_an_mtp_module_is_refused(tmp_path, llm):
    """The GGUF files llama.cpp's converter writes leave the module out; so does a checkpoint without it."""
    d = tmp_path / "plain"
    model = _hf_model(llm.engine.core.vocab_size)
    model.save_pretrained(d, safe_serialization=True)
    llm.get_tokenizer().save_pretrained(d)
    with pytest.raises(ValueError, match="no multi-token prediction module"):
        LLM(model=str(d), dtype="float32", max_model_len=128,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})
