"""Train (or sample from, or export) the MoE transformer over an n-dimensional device mesh.

    python main.py                                  # Shakespeare, bytes, small MoE, CPU
    python main.py --run.cpu_devices 8 --mesh.dp 2 --mesh.pp 2 --mesh.tp 2 --train.microbatches 2
    python main.py --mode sample --sample.prompt "JULIET:"
    python main.py --mode export                   # slim bfloat16 params in <run_dir>/export
    python main.py --mode export_hf                # a Hugging Face directory in <run_dir>/hf
    python main.py --mode eval                     # restore, print val_loss=... (any mesh)
    python main.py --mode serve                    # OpenAI-compatible completions + a web page (serve.py)

The script only: parse the command line, set up the devices, run the mode. Nothing
imports it. Training is train.py; the other modes are runs.py (sample, eval, export,
export_hf) and serve.py; devices.py sets up devices and processes.
"""

import sys
import traceback

# Importing these is fine before setup_devices: JAX starts its backend on first use.
import jax

import dtype_probe
import runs
from serving import serve
import train
from devices import setup_devices, stop_now
from utils import ConfigError, experts_kernel_for_sharding, parse_args

RUN_MODE = {  # what each --mode runs
    "train": train.train,
    "sample": lambda cfg: print(runs.sample_from_run(cfg)),
    "export": runs.export_run,
    "eval": runs.eval_run,
    "export_hf": runs.export_hf_run,
    "serve": serve.serve_run,
}


def main(argv):
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    several_processes = setup_devices(cfg)
    try:
        cfg = dtype_probe.resolve_dtype(cfg)  # --model.dtype auto: decided once, here; the run's config.json keeps it
        cfg = experts_kernel_for_sharding(cfg)
        RUN_MODE[cfg.mode](cfg)
    except (ConfigError, FileNotFoundError) as e:  # a missing data directory or shard names itself and what to give
        sys.exit(f"error: {e}")
    except Exception as e:
        if not several_processes:
            raise
        # An error in one process leaves the others stuck in a collective: stop now, so
        # that they in turn see the connection close and stop too (gloo on CPU raises
        # "Connection closed by peer", or "Read timeout" when the dead peer's socket was
        # mid-transfer; elsewhere JAX's heartbeat timeout stops them).
        traceback.print_exc()
        stop_now(f"error: process {jax.process_index()} of {jax.process_count()} stopped on {type(e).__name__} above. "
                 "If it reports a closed or reset connection or a read timeout, another process died or its host became unreachable: "
                 "see that process's log. Start all processes again to resume from the last checkpoint.")


if __name__ == "__main__":
    main(sys.argv[1:])
