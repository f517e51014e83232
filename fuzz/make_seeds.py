"""Seed corpora for the fuzz targets (fuzz/seeds/<target>/), small files that reach deep into
each parser. Deterministic: rerunning writes the same bytes.

    /work/venv/bin/python fuzz/make_seeds.py      # needs: pip install gguf numpy torch safetensors

The model_config target's fixed tiny config (MICRO_CONFIG in fuzz_targets/model_config.rs) is
the one written here, and the safetensors seed is a model of exactly that shape.
"""

import json
import pathlib
import shutil

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent
REPO = ROOT.parent
SEEDS = ROOT / "seeds"

MICRO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def clean(name):
    d = SEEDS / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def gguf_seeds():
    import gguf

    d = clean("gguf")
    rng = np.random.default_rng(0)
    path = d / "micro.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tokens = ["<s>", "</s>", "a", "b", "c", "Ġ", "ab", "Ġa", "bc", "abc"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["a b", "Ġ a", "b c", "ab c"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w.add_tensor("f32", x[:1, :32])
    w.add_tensor("f16", x[:1, :32].astype(np.float16))
    for ty in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K"]:
        qt = getattr(gguf.GGMLQuantizationType, ty)
        try:
            q = gguf.quants.quantize(x[:1], qt)
        except (NotImplementedError, gguf.quants.QuantError):
            continue
        w.add_tensor(ty.lower(), q, raw_dtype=qt)
    # K-quants the gguf package cannot quantise: blocks of seeded random bytes (256 values each).
    for ty in ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]:
        qt = getattr(gguf.GGMLQuantizationType, ty)
        size = gguf.GGML_QUANT_SIZES[qt][1]
        raw = np.frombuffer(rng.bytes(size), dtype=np.uint8).reshape(1, size)
        w.add_tensor(ty.lower(), raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def jsonl_seeds():
    d = clean("batch_jsonl")
    lines = (REPO / "fixtures/demo/data/ai/batch_input.jsonl").read_text().splitlines()[:3]
    (d / "demo.jsonl").write_text("\n".join(lines) + "\n")
    parts = {
        "custom_id": "p",
        "body": {
            "messages": [
                {"role": "system", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "again"},
            ]
        },
    }
    (d / "parts.jsonl").write_text("\ufeff" + json.dumps(parts) + "\n\n")
    (d / "array.json").write_text(json.dumps([parts, {"body": {"messages": []}}]))

    d = clean("qa_jsonl")
    qa = [
        {"question": "1+1?", "answer": 2},
        {"question": "q", "answer": "a", "p": "Think.", "s": "sys"},
        {"a": {"b": "nested"}, "c": ["first"]},
    ]
    (d / "qa.jsonl").write_text("\n".join(json.dumps(r) for r in qa) + "\n")
    (d / "qa.json").write_text(json.dumps(qa))


def model_seeds():
    import torch
    from safetensors.torch import save_file

    d = clean("model_config")
    for cfg in sorted((REPO / "fixtures/tiny-models").glob("*/config.json")):
        (d / f"{cfg.parent.name}.config").write_bytes(b"\x00" + cfg.read_bytes())
    c = MICRO_CONFIG
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.self_attn.q_proj.weight": (h, h),
        "model.layers.0.self_attn.k_proj.weight": (kv, h),
        "model.layers.0.self_attn.v_proj.weight": (kv, h),
        "model.layers.0.self_attn.o_proj.weight": (h, h),
        "model.layers.0.mlp.gate_proj.weight": (i, h),
        "model.layers.0.mlp.up_proj.weight": (i, h),
        "model.layers.0.mlp.down_proj.weight": (h, i),
    }
    tensors = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    tmp = d / "tmp.safetensors"
    save_file(tensors, str(tmp))
    (d / "micro.safetensors").write_bytes(b"\x01" + tmp.read_bytes())
    tmp.unlink()
    print("MICRO_CONFIG =", json.dumps(c))

    d = clean("distill_config")
    demo = (REPO / "examples/distill/demo.yaml").read_text()
    overrides = "kd_objective=reverse_kl\nmax_steps=5\n+student.lora_rank=4\nexp_name=${seed}"
    (d / "demo").write_text(demo + "\0" + overrides)
    (d / "interp").write_text("a: ${b}\nb: ${a}\n\0seed=1")


if __name__ == "__main__":
    gguf_seeds()
    jsonl_seeds()
    model_seeds()
