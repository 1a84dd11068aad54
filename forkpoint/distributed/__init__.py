"""Tensor parallelism of one engine over torch.distributed (gloo on CPU, NCCL on CUDA):

    shares.py         the ranges of a split tensor a rank holds (`Pieces`)
    sharding.py       which slice of every weight a rank holds; the rank's local ModelConfig (Qwen)
    mamba2_sharding.py  the same for the Mamba2 hybrids: the mixer split by heads and groups
    collectives.py    the process group of one engine (no torch.distributed default group)
    parallel_model.py the Qwen3.5 / Qwen3-Next model with vocab-parallel embedding and lm_head and
                      one all-reduce per attention / MLP block
    parallel_layers.py  modules a rank swaps in under the same parameter names (all-reduce hook,
                      vocab-parallel embedding / lm_head, the gated norm of a split norm group)
    parallel_mamba2.py  a Mamba2 hybrid's family class on one rank, with those modules swapped in
    loading.py        each rank reads only its slices of the safetensors files; dummy weights per shard
    images.py         rank 0 encodes a step's images; rows and positions broadcast to the workers
    worker.py         the loop of ranks > 0: receive a StepPlan, apply its device writes to the rank's
                      storage and run the same forward on the shard
    runner.py         TensorParallelRunner: ModelRunner's interface on rank 0 (the engine process)

Routing among engine replicas (the checkpoint-affine router) composes the server, so it lives in
`forkpoint.server.replicas`.
"""
