"""Named sizes of the reference decoder.

Each preset is a complete set of `ModelConfig` fields. The published sizes use the
architectures' real vocabularies and shapes so that their parameter counts match the papers:
GPT-2 124M (Radford et al. 2019), GPT-3 175B (Brown et al. 2020, table 2.1),
Llama 2 7B / 70B (Touvron et al. 2023) and Llama 3 405B (Dubey et al. 2024, table 3).
`tiny` and `small` use the byte-level vocabulary (256) of threefold's own tokenizer.

The published sizes pad their embedding and head to a multiple of 128 rows (`vocab_multiple`:
GPT-2's 50257 -> 50304, Llama 3's 128256 stays) for the GPU's matmul tiles; the real vocabulary
stays `vocab`, and PUBLISHED_PARAMS is compared with the count of the real rows
(`count_parameters(cfg, padded=False)`). The test sizes keep 1: their vocabulary (256) is already a
multiple of 128, and a prepared dataset's tokenizer replaces it with its own (257 for bytes).

Mixtures of experts (models/moe.py): `tiny-moe` for tests, `small-moe` (8 experts, top-2, whose
active MLP width equals `small`'s), Mixtral 8x7B (Jiang et al. 2024) and a DeepSeek-V3-sized
model (DeepSeek-AI 2024: 61 blocks, the first 3 dense, 256 routed experts of width 2048, top-8,
one shared expert). DeepSeek-V3's multi-head latent attention is replaced by grouped-query
attention of the same size (128 heads of 96, 8 key/value heads: 187.2M parameters per block
against MLA's 187.1M), so the counts match while the attention is the decoder's own.
"""

_GPT = dict(mlp="gelu", norm="layernorm", position="learned", tie_embeddings=True, bias=True)
_LLAMA = dict(mlp="swiglu", norm="rmsnorm", position="rope", tie_embeddings=False, bias=False)

_GPT128, _LLAMA128 = dict(_GPT, vocab_multiple=128), dict(_LLAMA, vocab_multiple=128)  # the published sizes

PRESETS: dict[str, dict] = {
    # For unit and parity tests: a few thousand parameters, milliseconds per step.
    "tiny": dict(_GPT, layers=2, hidden=32, heads=4, kv_heads=4, ffn_hidden=128, vocab=256, max_seq=64),
    "tiny-llama": dict(_LLAMA, layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=96, vocab=256, max_seq=64),
    # The CPU demo: ~3.3M parameters, learns byte-level Python in a few minutes on two cores.
    "small": dict(_GPT, layers=4, hidden=256, heads=4, kv_heads=4, ffn_hidden=1024, vocab=256, max_seq=256),
    "gpt2-124m": dict(_GPT128, layers=12, hidden=768, heads=12, kv_heads=12, ffn_hidden=3072, vocab=50257, max_seq=1024),
    "gpt3-175b": dict(_GPT128, layers=96, hidden=12288, heads=96, kv_heads=96, ffn_hidden=49152, vocab=50257, max_seq=2048),
    "llama-7b": dict(_LLAMA128, layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000, max_seq=4096),
    "llama-70b": dict(_LLAMA128, layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=32000, max_seq=4096),
    "llama-405b": dict(_LLAMA128, layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256,
                       max_seq=8192, rope_theta=500000.0),
    "tiny-moe": dict(_LLAMA, layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=96, vocab=256, max_seq=64,
                     experts=4, experts_top_k=2, expert_ffn_hidden=48),
    "small-moe": dict(_GPT, layers=4, hidden=256, heads=4, kv_heads=4, ffn_hidden=1024, vocab=256, max_seq=256,
                      experts=8, experts_top_k=2, expert_ffn_hidden=512),
    "mixtral-8x7b": dict(_LLAMA128, layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
                         max_seq=32768, rope_theta=1e6, experts=8, experts_top_k=2),
    "deepseek-v3": dict(_LLAMA128, layers=61, hidden=7168, heads=128, kv_heads=8, head_size=96, ffn_hidden=18432,
                        vocab=129280, max_seq=4096, experts=256, experts_top_k=8, shared_experts=1,
                        expert_ffn_hidden=2048, moe_start=3),
}

# Published parameter counts, for the tests that check the presets against the papers.
PUBLISHED_PARAMS: dict[str, int] = {
    "gpt2-124m": 124_439_808,
    "gpt3-175b": 175_000_000_000,
    "llama-7b": 6_738_415_616,
    "llama-70b": 68_976_648_192,
    "llama-405b": 405_000_000_000,
    "mixtral-8x7b": 46_702_792_704,  # "46.7B total parameters" (the exact count of the released weights)
    "deepseek-v3": 671_000_000_000,  # "671B total parameters" (without the 14B multi-token prediction module)
}

# Published parameters used per token (mixtures of experts): "12.9B" and "37B activated".
PUBLISHED_ACTIVE: dict[str, int] = {
    "mixtral-8x7b": 12_900_000_000,
    "deepseek-v3": 37_000_000_000,
}
