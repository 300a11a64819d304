"""A sentence-transformers folder's modules (``modules.json``): how the encoder's token states become one vector.
Read here, as sentence-transformers defines them: ``Pooling`` (mean, cls or last token, from ``1_Pooling``),
``Dense`` layers (``N_Dense``: a linear map with an optional bias and activation), ``Normalize``; the prompts the
model declares (``config_sentence_transformers.json``: EmbeddingGemma's ``query`` / ``document``) and its
``max_seq_length`` (``sentence_bert_config.json``). No torch here: the dense weights are read by ``load_dense``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# sentence-transformers' pooling_mode_* keys -> the engine's pooling names
_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}  # sentence-transformers 6's names
_UNSUPPORTED_POOLING = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")
ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
# a pagedllm file beside the model: what the folder does not say (e.g. the Matryoshka sizes a model card lists)
EXTRA_FILE = "pagedllm_model.json"


@dataclass(frozen=True)
class DenseSpec:
    path: str  # the module's folder
    in_features: int
    out_features: int
    bias: bool
    activation: str  # "identity" or "tanh"


@dataclass(frozen=True)
class SentenceModules:
    pooling: str
    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    matryoshka_dimensions: tuple[int, ...] = ()  # sizes the model was trained to be truncated to

    @property
    def dimension(self) -> int | None:
        return self.dense[-1].out_features if self.dense else None


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_sentence_modules(path: str) -> SentenceModules | None:
    """The folder's modules, or None when it is not a sentence-transformers folder. A module this engine does not
    run (max pooling, a custom module, a pooling that leaves the prompt out) stops the load with its name."""
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "modules.json")):
        return None
    pooling, dense, normalize = None, [], False
    for m in sorted(_json(os.path.join(path, "modules.json")), key=lambda m: m.get("idx", 0)):
        kind, where = m["type"].rsplit(".", 1)[-1], os.path.join(path, m.get("path", ""))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            cfg = _json(os.path.join(where, "config.json"))
            if "pooling_mode" in cfg:  # sentence-transformers 6: a mode or a list of them
                given = [cfg["pooling_mode"]] if isinstance(cfg["pooling_mode"], str) else list(cfg["pooling_mode"])
                modes = [_MODES[m] for m in given if m in _MODES]
                bad = [m for m in given if m not in _MODES]
            else:  # older: a flag per mode
                bad = [k for k in _UNSUPPORTED_POOLING if cfg.get(k)]
                modes = [v for k, v in _POOLING.items() if cfg.get(k)]
            if bad or len(modes) != 1:
                raise ValueError(f"{path}: pooling {bad or modes or 'none'} is not supported (one of mean, cls, "
                                 "last token is)")
            if cfg.get("include_prompt", True) is False:
                raise ValueError(f"{path}: pooling without the prompt's tokens (include_prompt: false) is not "
                                 "supported")
            pooling = modes[0]
        elif kind == "Dense":
            cfg = _json(os.path.join(where, "config.json"))
            act = cfg.get("activation_function", "torch.nn.modules.linear.Identity")
            if cfg.get("use_residual"):
                raise ValueError(f"{path}: a Dense layer with a residual connection is not supported")
            if act not in ACTIVATIONS:
                raise ValueError(f"{path}: Dense activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
            dense.append(DenseSpec(where, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)),
                                   ACTIVATIONS[act]))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{path}: sentence-transformers module {m['type']!r} is not supported")
    if pooling is None:
        raise ValueError(f"{path}: modules.json has no Pooling module")
    st = os.path.join(path, "config_sentence_transformers.json")
    st_cfg = _json(st) if os.path.exists(st) else {}
    bert = os.path.join(path, "sentence_bert_config.json")
    max_len = _json(bert).get("max_seq_length") if os.path.exists(bert) else None
    tok = os.path.join(path, "tokenizer_config.json")
    if max_len is None and os.path.exists(tok):  # sentence-transformers 6 keeps it as the tokenizer's
        max_len = _json(tok).get("model_max_length")
        max_len = int(max_len) if isinstance(max_len, (int, float)) and max_len < 1 << 30 else None
    extra = os.path.join(path, EXTRA_FILE)
    dims = _json(extra).get("matryoshka_dimensions", ()) if os.path.exists(extra) else ()
    return SentenceModules(pooling, tuple(dense), normalize, dict(st_cfg.get("prompts") or {}),
                           st_cfg.get("default_prompt_name"), max_len, tuple(int(d) for d in dims))
