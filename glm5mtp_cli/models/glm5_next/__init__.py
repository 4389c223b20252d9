"""GLM-5-Next (`glm5_next`, GLM-5.3-Flash): target + MTP layer, PyTorch path (CPU/CUDA, fp32/bf16).

One concern per module: config (NextConfig), layout (checkpoint names/shapes), mhc (streams),
kda (linear attention + its rollback records), indexer (pooled DSA), attention (NoPE MLA),
decoder (the target's modules, DEFAULT_ROLLBACK), mtp (the MTP layer), load (lazy loading through
CheckpointReader), pooled / paged (both over the engine's pools, B sequences per forward), training
(the differentiable forward), sharding (tp), family (the ModelFamily). The one-sequence reference
the tests hold these against is tests/glm5next_reference.py; tests/bench_rollback.py is the
measurement behind decoder.DEFAULT_ROLLBACK. The package, config, layout, sizing and family import no
torch (`info` reads the config alone): the family imports the modules when it builds a model.
"""
