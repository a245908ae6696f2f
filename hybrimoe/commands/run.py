"""``hybrimoe run``: generate text from a prompt, with llama.cpp's flags and, with ``--moe-cache``, the hybrid engine.

The text streams to stdout; on stderr, llama.cpp-style timings at the end (prompt and generation tokens/s, from
llama.cpp's own context timer) and, with the engine, its hit rate.
"""
from __future__ import annotations

import argparse
import json
import sys

from hybrimoe.commands.args import COUNT, id_ranges
from hybrimoe.commands.llama_args import add_llama_arguments, load_llama, model_argument

HELP = "generate text (llama.cpp flags)"
DESCRIPTION = "generate text"
DEFAULT_PROMPT = "Once upon a time"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``run`` flags: the prompt, the tokens to generate, the shared llama flags and the output's form."""
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="prompt text (default: %(default)r)")
    p.add_argument("-n", "--n-predict", type=COUNT, default=32,
                   help="tokens to generate (default: %(default)s; generation also stops at the context's end, -c)")
    add_llama_arguments(p)
    p.add_argument("--replay-trace", default=None, metavar="TRACE.npz",
                   help="force every MoE layer's expert ids from a routing trace (token at position p gets row "
                        "p mod rows): real activation patterns on a synthetic model; the text is then meaningless")
    p.add_argument("--moe-stats", action="store_true",
                   help="print the engine's statistics (hit rate, CPU/GPU experts, bytes copied) on stderr")
    p.add_argument("--output-format", choices=["text", "json"], default="text",
                   help="text: stream the generated text; json: print {prompt_tokens, tokens, text, n_ctx} at the end")


def _routing_replay(args, model):
    """The ``--replay-trace`` table, or None; raises ValueError / FileNotFoundError naming the flag."""
    from hybrimoe.traces.routing_replay import routing_replay_table

    if not args.replay_trace:
        return None
    try:
        table = routing_replay_table(args.replay_trace, model)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--replay-trace: {e}") from None
    print(f"hybrimoe: routing replayed from {args.replay_trace} ({len(table)} rows): the generated text is "
          "meaningless", file=sys.stderr)
    return table


def _print_engine_stats(stats: dict) -> None:
    e = stats["engine"]
    if e["n_slots"] == 0:  # no GPU cache (the RAM tier alone, or moe_cache=0): every expert on the CPU
        print(f"hybrimoe: engine {e['policy']}: no GPU cache, every expert on the CPU ({e['cpu_experts']}), "
              f"{e['layer_s'] * 1e6:.0f} us per MoE layer", file=sys.stderr)
        return
    print(f"hybrimoe: engine {e['policy']}: {e['n_slots']} slots of {e['slot_bytes']} B, hit rate "
          f"{e['hit_rate']:.3f}, experts CPU {e['cpu_experts']} / GPU {e['gpu_experts']}, H2D "
          f"{e['bytes_copied'] / 2**20:.1f} MiB, {e['layer_s'] * 1e6:.0f} us per MoE layer; cost model: "
          f"{e['cost_model']}" + (f"; profile: {e['profile']}" if e.get("profile") else ""), file=sys.stderr)


def timing_lines(gen, stats: dict) -> list[str]:
    """llama.cpp-style timings of a :class:`hybrimoe.runtime.generate.Generation` (llama_perf_context_print's
    figures: prompt eval and eval, milliseconds, ms per token, tokens per second), and the engine's hit rate."""
    lines = []
    for what, n, s in (("prompt eval time", gen.n_prompt_eval, gen.prompt_s), ("eval time", gen.n_decode,
                                                                                gen.decode_s)):
        per = f"{1e3 * s / n:8.2f} ms per token, {n / s:8.2f} tokens per second" if n and s > 0 else "-"
        lines.append(f"hybrimoe: {what:>16} = {1e3 * s:10.2f} ms / {n:5d} tokens ({per})")
    if "engine" in stats:
        e = stats["engine"]
        if e["n_slots"] > 0:  # no GPU cache (the RAM tier alone, or moe_cache=0): no GPU line
            lines.append(f"hybrimoe: engine hit rate {e['hit_rate']:.3f} ({e['cache']['hits']} of "
                         f"{e['cache']['accesses']} activated experts resident), {e['bytes_copied'] / 2**20:.1f} MiB "
                         "copied to the device")
            if e.get("all_cpu_reason"):
                lines.append(f"hybrimoe: {e['all_cpu_reason']}")
            devs = e.get("devices") or []
            for i, d in enumerate(devs):
                host = d.get("host_moe_layers") or []
                own = [ml for ml in d["moe_layers"] if ml not in host]
                span = (f"MoE layers {id_ranges(own)}" if own else "") + (
                    f"{' and ' if own else 'MoE layers '}{id_ranges(host)} left on the host" if host else "")
                lines.append(f"hybrimoe:   device {i} ({d['device']}): {span or 'no MoE layer'}, "
                             f"{d['n_slots']} slots, hit rate {d['hit_rate']:.3f}, {d['gpu_experts']} experts run, "
                             f"{d['bytes_copied'] / 2**20:.1f} MiB copied")
        r = e.get("ram") or {}
        if r:
            ahead = (f"{r['bytes_prefetch'] / 2**20:.1f} MiB of it ahead, prefetch accuracy "
                     f"{r['prefetch_accuracy']:.2f}" if r['prefetch_reads'] else "none ahead")
            lines.append(f"hybrimoe: RAM tier hit rate {r['hit_rate']:.3f} ({r['hits']} of {r['accesses']}; "
                         f"{r['n_slots']} slots of {r['slot_bytes']} B), {r['bytes_read'] / 2**20:.1f} MiB read from "
                         f"the file ({ahead}; {r.get('in_place_matrices', 0)} of {r.get('direct_matrices', 0)} direct "
                         f"reads in place), {1e3 * r['wait_s']:.1f} ms waiting for reads; "
                         f"{e.get('cpu_late_experts', 0)} of {e['cpu_experts']} CPU experts computed in the second "
                         "pass, after their reads")
            if r.get("exclusive"):
                lines.append(f"hybrimoe: exclusive tiers: {r['given_up']} RAM slots given up by experts on the GPU, "
                             f"{r['demotions']} GPU evictions copied back into RAM")
    return lines


def run(args: argparse.Namespace) -> int:
    """Runs ``hybrimoe run``: 0 ok, 1 the model cannot be loaded or generation failed, 2 bad flags."""
    from hybrimoe.runtime.generate import generate

    prog = "hybrimoe run"
    if args.prompt == "":
        print(f"{prog}: error: the prompt is empty (-p TEXT)", file=sys.stderr)
        return 2
    engine_on = args.moe_cache is not None or args.moe_ram_cache is not None
    if args.moe_stats and not engine_on:  # the statistics are the engine's: without it there are none
        print(f"{prog}: error: --moe-stats prints the engine's statistics and needs --moe-cache or --moe-ram-cache "
              "(the engine)",
              file=sys.stderr)
        return 2
    model = model_argument(args, prog)
    if model is None:
        return 1
    try:
        routing_table = _routing_replay(args, model)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    llm = load_llama(args, model, prog, moe_replay=routing_table)
    if llm is None:
        return 1
    try:
        prompt_tokens = llm.tokenize(args.prompt.encode(), add_bos=True, special=False)
        if len(prompt_tokens) >= llm.n_ctx():
            print(f"{prog}: error: the prompt has {len(prompt_tokens)} tokens, the context holds {llm.n_ctx()} (-c)",
                  file=sys.stderr)
            return 1
        try:
            gen = generate(llm, prompt_tokens, args.n_predict, temp=args.temp, top_k=args.top_k, top_p=args.top_p,
                           stream=sys.stdout if args.output_format == "text" else None)
        except (RuntimeError, ValueError) as e:
            print(f"\n{prog}: error: generation failed: {e}", file=sys.stderr)
            return 1
        stats = llm.moe_stats() if (args.moe_hook or engine_on) else {}
        if args.output_format == "json":
            text = llm.detokenize(gen.tokens).decode("utf-8", errors="replace")
            json.dump({"prompt_tokens": prompt_tokens, "tokens": gen.tokens, "text": text, "n_ctx": llm.n_ctx()},
                      sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if gen.stop == "context":
            print(f"{prog}: generation stopped at the end of the context ({llm.n_ctx()} tokens: {len(prompt_tokens)} "
                  f"prompt + {len(gen.tokens)} generated, of -n {args.n_predict}); -c raises it", file=sys.stderr)
        for line in timing_lines(gen, stats):
            print(line, file=sys.stderr)
        if args.moe_stats and "engine" in stats:
            _print_engine_stats(stats)
    finally:
        llm.close()
    return 0
