"""Named sizes of the reference decoder.

Each preset is a complete set of `ModelConfig` fields. The published sizes use the
architectures' real vocabularies and shapes so that their parameter counts match the papers:
GPT-2 124M (Radford et al. 2019), GPT-3 175B (Brown et al. 2020, table 2.1),
Llama 2 7B / 70B (Touvron et al. 2023) and Llama 3 405B (Dubey et al. 2024, table 3).
`tiny` and `small` use the byte-level vocabulary (256) of threefold's own tokenizer.
"""

_GPT = dict(mlp="gelu", norm="layernorm", position="learned", tie_embeddings=True, bias=True)
_LLAMA = dict(mlp="swiglu", norm="rmsnorm", position="rope", tie_embeddings=False, bias=False)

PRESETS: dict[str, dict] = {
    # For unit and parity tests: a few thousand parameters, milliseconds per step.
    "tiny": dict(_GPT, layers=2, hidden=32, heads=4, kv_heads=4, ffn_hidden=128, vocab=256, max_seq=64),
    "tiny-llama": dict(_LLAMA, layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=96, vocab=256, max_seq=64),
    # The CPU demo: ~3.3M parameters, learns byte-level Python in a few minutes on two cores.
    "small": dict(_GPT, layers=4, hidden=256, heads=4, kv_heads=4, ffn_hidden=1024, vocab=256, max_seq=256),
    "gpt2-124m": dict(_GPT, layers=12, hidden=768, heads=12, kv_heads=12, ffn_hidden=3072, vocab=50257, max_seq=1024),
    "gpt3-175b": dict(_GPT, layers=96, hidden=12288, heads=96, kv_heads=96, ffn_hidden=49152, vocab=50257, max_seq=2048),
    "llama-7b": dict(_LLAMA, layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000, max_seq=4096),
    "llama-70b": dict(_LLAMA, layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=32000, max_seq=4096),
    "llama-405b": dict(_LLAMA, layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256,
                       max_seq=8192, rope_theta=500000.0),
}

# Published parameter counts, for the tests that check the presets against the papers.
PUBLISHED_PARAMS: dict[str, int] = {
    "gpt2-124m": 124_439_808,
    "gpt3-175b": 175_000_000_000,
    "llama-7b": 6_738_415_616,
    "llama-70b": 68_976_648_192,
    "llama-405b": 405_000_000_000,
}
