"""The traced step (ray_zero/train/step_trace.py) against the same step run for real on a GPU.

For each case: the step traced on the meta device (what `estimate` and a sweep predict), the same step
run on the GPU with the same tracker on its real tensors (the operators' own outputs), and the CUDA
caching allocator's rise over the step (max_memory_allocated above what was allocated before it, after
two warm-up steps). The three rises side by side, the attention kernel CUDA chose for each
scaled_dot_product_attention (torch._fused_sdp_choice), and the largest operators at each peak: where
meta and CUDA differ, which operator.

    python bench/trace_gpu.py --output DIR [--only NAME ...] [--budget-s 480]   # on the GPU machine
    python bench/trace_gpu.py --table DIR/trace_gpu.jsonl                       # the table, anywhere
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30
LLAMA_1B = dict(
    hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
    intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
)  # fmt: skip
MOE = dict(
    hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
    intermediate_size=2816, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
    max_position_embeddings=4096,
)  # fmt: skip
T5 = dict(d_model=768, d_ff=3072, num_layers=12, num_decoder_layers=12, num_heads=12, d_kv=64)

# name, model, model_config, seq_len, micro-batch, forms ((backend, precision, checkpointing), ...)
LOW, AUTO, CK = ("deepspeed", "bf16", False), ("torch_zero", "bf16", False), ("deepspeed", "bf16", True)
FP16, FP32 = ("deepspeed", "fp16", False), ("deepspeed", "fp32", False)
CASES = [
    ("t5", "hf:t5", T5, 512, 4, (LOW, AUTO, FP32)),
    ("bert", "hf:bert", {}, 512, 8, (LOW, AUTO, CK)),
    ("gpt2", "hf:gpt2", {}, 1024, 4, (LOW, AUTO, FP16, CK, FP32)),
    ("llama", "hf:llama", LLAMA_1B, 2048, 1, (LOW, AUTO)),
    ("mixtral", "hf:mixtral", MOE, 1024, 2, (LOW, AUTO, FP16)),
    ("vit", "timm:vit_base_patch16_224", {}, None, 32, (LOW, AUTO)),
    ("convnext", "timm:convnext_tiny", {}, None, 32, (LOW, AUTO)),
    ("resnet50", "timm:resnet50", {}, None, 64, (LOW, AUTO, FP32)),
    ("large", "large", {}, None, 64, (LOW, CK)),
    # families the zoo never ran
    ("qwen2", "hf:qwen2", dict(hidden_size=896, num_hidden_layers=12, num_attention_heads=14,
                               num_key_value_heads=2, intermediate_size=4864, vocab_size=32000), 1024, 2,
     (LOW, AUTO)),
    ("roberta", "hf:roberta", {}, 510, 8, (LOW, AUTO)),
    ("bart", "hf:bart", {}, 512, 4, (LOW, AUTO)),
    ("opt", "hf:opt", dict(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12),
     1024, 4, (LOW, AUTO)),
    ("gemma", "hf:gemma", dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8,
                               num_key_value_heads=1, intermediate_size=4096, head_dim=128,
                               vocab_size=32000), 1024, 2, (LOW,)),
    ("distilbert", "hf:distilbert", {}, 512, 8, (LOW, AUTO)),
    ("deit", "timm:deit_small_patch16_224", {}, None, 64, (LOW, AUTO)),
    ("efficientnet", "timm:efficientnet_b0", {}, None, 64, (LOW, AUTO)),
    ("swin", "timm:swin_tiny_patch4_window7_224", {}, None, 32, (LOW,)),
    ("mobilenet", "timm:mobilenetv3_large_100", {}, None, 64, (LOW,)),
    ("hf_vit", "hf:vit", {}, None, 32, (LOW, AUTO)),
    ("whisper", "hf:whisper", {}, None, 4, (LOW,)),
]  # fmt: skip


def run_case(name, model, config, seq_len, micro, backend, precision, checkpointing) -> dict:
    import torch

    from ray_zero.models.describe import build_model_spec
    from ray_zero.models.source import ModelSource
    from ray_zero.train import cuda_kernels
    from ray_zero.train.step_trace import build_on_meta, module_form, prepare, trace_step

    source = ModelSource(model, dict(config) or None, seq_len)
    form = module_form(backend, precision)
    record = dict(case=name, model=model, backend=backend, precision=precision, form=form.name,
                  checkpointing=checkpointing, micro_batch=micro)  # fmt: skip
    started = time.perf_counter()
    spec = build_on_meta(lambda: build_model_spec(source))
    prepare(spec, form, checkpointing)
    traced = trace_step(spec, micro, form, checkpointing)
    record["meta"] = _figures(traced)
    record["meta_s"] = time.perf_counter() - started
    del spec

    torch.manual_seed(0)
    with torch.device("cuda"):
        spec = build_model_spec(source)
    prepare(spec, form, checkpointing)
    choices: list = []
    original = cuda_kernels._SDPA  # what a traced step's attention calls on a real device

    def logged(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        choice = torch._fused_sdp_choice(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )  # torch 2.11 takes scale and enable_gqa as keywords only
        choices.append(int(choice))
        return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    cuda_kernels._SDPA = logged
    try:
        for _ in range(2):  # warm-up: workspaces, lazy buffers, cuDNN's choices
            trace_step(spec, micro, form, checkpointing, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        choices.clear()
        real = trace_step(spec, micro, form, checkpointing, device="cuda")
        torch.cuda.synchronize()
        rise = torch.cuda.max_memory_allocated() - before
    finally:
        cuda_kernels._SDPA = original
    record["cuda"] = _figures(real)
    record["allocator_rise_bytes"] = rise
    record["sdp_choices"] = {str(c): choices.count(c) for c in sorted(set(choices))}
    record["seconds"] = time.perf_counter() - started
    del spec
    torch.cuda.empty_cache()
    return record


def _figures(trace) -> dict:
    return dict(
        rise_bytes=trace.rise(trace.gradient_bytes),
        forward_bytes=trace.forward_bytes,
        saved_bytes=trace.saved_bytes,
        gradient_bytes=trace.gradient_bytes,
        attention=dict(trace.attention),
        composition=[list(item) for item in trace.composition],
    )


def table(path: Path) -> str:
    lines = [
        "| case | form | ckpt | mb | meta rise GiB | CUDA ops GiB | allocator GiB | allocator/meta | "
        "SDPA (CUDA, _fused_sdp_choice) | meta attention |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "error" in r:
            lines.append(f"| {r['case']} | {r.get('form', '')} | | | error: {r['error'][:80]} | | | | | |")
            continue
        meta, cuda = r["meta"]["rise_bytes"], r["cuda"]["rise_bytes"]
        alloc = r["allocator_rise_bytes"]
        lines.append(
            f"| {r['case']} | {r['form']} | {r['checkpointing']} | {r['micro_batch']} | {meta / GIB:.3f} | "
            f"{cuda / GIB:.3f} | {alloc / GIB:.3f} | {alloc / meta:.3f} | {r['sdp_choices'] or '-'} | "
            f"{r['meta']['attention']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--budget-s", type=float, default=480)
    parser.add_argument("--table", type=Path)
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    import torch

    args.output.mkdir(parents=True, exist_ok=True)
    out = args.output / "trace_gpu.jsonl"
    started = time.time()
    with open(out, "a") as sink:
        for name, model, config, seq_len, micro, forms in CASES:
            if args.only and name not in args.only:
                continue
            for backend, precision, checkpointing in forms:
                if time.time() - started > args.budget_s:
                    print(f"trace_gpu: budget spent, stopping before {name}", flush=True)
                    return 0
                try:
                    record = run_case(name, model, config, seq_len, micro, backend, precision, checkpointing)
                except Exception as error:  # one line, and the next case
                    record = dict(case=name, form=f"{backend} {precision}", checkpointing=checkpointing,
                                  error=f"{type(error).__name__}: {error}"[:300],
                                  where=traceback.format_exc()[-600:])  # fmt: skip
                    torch.cuda.empty_cache()
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                if "error" in record:
                    print(f"trace_gpu: {name} {backend} {precision}: {record['error'][:200]}", flush=True)
                else:
                    meta, cuda = record["meta"]["rise_bytes"], record["cuda"]["rise_bytes"]
                    print(
                        f"trace_gpu: {name} {record['form']} ck={checkpointing} mb{micro}: meta "
                        f"{meta / GIB:.3f} cuda-ops {cuda / GIB:.3f} allocator "
                        f"{record['allocator_rise_bytes'] / GIB:.3f} GiB sdp {record['sdp_choices']} "
                        f"({record['seconds']:.1f} s)",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
