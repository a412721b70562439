"""`python -m bench.vllm_parity`: the command line of the benchmark its package describes."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import tempfile
from pathlib import Path

from bench import vllm_parity as benchmark
from bench.kit.environment import environment_info
from bench.kit.results import RESULTS_DIR, write_results
from bench.vllm_parity.checkpoint import make_parity_model
from bench.vllm_parity.measure import Server, compare, vllm_extra
from bench.vllm_parity.report import markdown
from bench.vllm_parity.servers import our_app, vllm_command, vllm_server
from workers.vllm_backend.venv import ensure_vllm_python, vllm_env


def vllm_version() -> str:
    return subprocess.run([str(ensure_vllm_python()), "-c", "import vllm; print(vllm.__version__)"], env=vllm_env(),
                          capture_output=True, text=True, check=True).stdout.strip()


def _shown(command: list[str]) -> list[str]:
    """The command as the report shows it: the checkpoint's temporary folder and the port named."""
    shown = list(command)
    shown[shown.index("--model") + 1], shown[shown.index("--port") + 1] = "<checkpoint>", "<free port>"
    return shown


def main() -> None:
    parser = argparse.ArgumentParser(description=benchmark.__doc__.split("\n\n")[0])
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-parity-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = make_parity_model(tmp / "parity-model")
        # Started one after the other (each waits for its health check), then both serve the cases.
        with vllm_server(model_dir, tmp) as (vllm_url, vllm_model, vllm_start), \
                our_app(model_dir, tmp) as (our_url, our_model, our_start):
            rows = compare(Server("vllm", vllm_url, vllm_model, vllm_extra(model_dir)),
                           Server("ours", our_url, our_model, {}), model_dir)
    data = {"environment": environment_info(), "checkpoint": "tiny GraniteMoeHybrid, dense, 32-wide heads, seed 4",
            "vllm_version": vllm_version(), "hybridserve": importlib.metadata.version("hybridserve"),
            "servers": {"vllm": {"command": _shown(vllm_command(model_dir, 0)), "start_s": vllm_start},
                        "ours": {"start_s": our_start}}, "rows": rows}
    json_path, md_path = write_results("vllm_parity", data, markdown(data), args.results_dir)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
