"""One rank of a gloo world that reads DeepSpeed configs with DeepSpeed's own ``DeepSpeedConfig``.

Run by tests/test_engines.py under ``torchrun --nproc-per-node N``: every rank starts DeepSpeed's
process group (gloo) and parses each config in the JSON list it is given, so DeepSpeed takes its
world size from the real group, not from a stand-in; rank 0 writes what DeepSpeed read (or the
error it raised) for each config.
"""

import json
import sys

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig


def _name(device) -> str:
    return str(getattr(device, "value", device))


def read(config: dict) -> dict:
    try:
        parsed = DeepSpeedConfig(config)
    except (AssertionError, ValueError) as error:  # DeepSpeed's own refusals
        return {"error": f"{type(error).__name__}: {error}"}
    zero = parsed.zero_config
    offload_param = zero.offload_param
    return {
        "world_size": parsed.world_size,
        "train_batch_size": parsed.train_batch_size,
        "stage": parsed.zero_optimization_stage,
        "optimizer": parsed.optimizer_name,
        "bf16": parsed.bfloat16_config.enabled,
        "fp16": parsed.float16_config.enabled,
        "gradient_clipping": parsed.gradient_clipping,
        "offload_optimizer": None
        if zero.offload_optimizer is None
        else _name(zero.offload_optimizer.device),
        "offload_param": None if offload_param is None else _name(offload_param.device),
        "buffer_size": None if offload_param is None else offload_param.buffer_size,
        "nvme_path": None
        if offload_param is None or offload_param.nvme_path is None
        else str(offload_param.nvme_path),
        "offload_ratio": None if zero.offload_optimizer is None else zero.offload_optimizer.ratio,
        "zenflow_update_interval": None if zero.zenflow is None else zero.zenflow.update_interval,
        "aio_queue_depth": parsed.aio_config["queue_depth"],
    }


def main(configs_path: str, out_path: str) -> None:
    # On a CPU-only machine DeepSpeed would first compile its shared-memory collectives (minutes on
    # two cores), which play no part in reading a config: mark them unavailable, and it uses gloo
    # alone.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    configs = json.loads(open(configs_path, encoding="utf-8").read())
    results = [read(config) for config in configs]
    if deepspeed.comm.get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as out:
            json.dump({"world": deepspeed.comm.get_world_size(), "results": results}, out)
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
