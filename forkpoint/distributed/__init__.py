"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

    sharding.py       which slice of every weight a rank holds; the rank's local ModelConfig
    collectives.py    the process group of one engine (no torch.distributed default group)
    parallel_model.py the Qwen3.5 / Qwen3-Next model with vocab-parallel embedding and lm_head and
                      one all-reduce per attention / MLP block
    loading.py        each rank reads only its slices of the safetensors files; dummy weights per shard
    pools.py          the rank-0 state pool that mirrors its out-of-forward row copies to the workers
    worker.py         the loop of ranks > 0: receive a StepPlan, run the same forward on the shard
    runner.py         TensorParallelRunner: ModelRunner's interface on rank 0 (the engine process)
"""
