"""Run in the lm-eval venv (client_venvs.py), not by pytest: lm-eval's `local-completions` model
on a multiple-choice task defined here over a local JSONL (no dataset download), the tokenizer
read from the checkpoint directory the app serves. Prints, as JSON for test_lm_eval.py, the
task's accuracy and the log-likelihood lm-eval computed for each (context, continuation).

    python lm_eval_loglikelihood.py BASE_URL MODEL CHECKPOINT_DIR DOCS_JSONL

Each line of DOCS_JSONL is {"question": str, "choices": [str, ...], "answer": int}.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

TASK = "hybridserve_multiple_choice"


def task_config(docs: Path) -> dict:
    """lm-eval's task YAML: the `json` builder of `datasets` reads the local file."""
    return {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(docs)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }


def main(base_url: str, model: str, checkpoint_dir: str, docs_file: str) -> None:
    docs = Path(docs_file)
    with tempfile.TemporaryDirectory() as task_dir:
        # JSON is YAML: lm-eval's loader reads it as the YAML task file it looks for.
        (Path(task_dir) / f"{TASK}.yaml").write_text(json.dumps(task_config(docs)))
        # `datasets` keeps what it built from the JSONL here, not in the home's cache (read at import).
        os.environ["HF_DATASETS_CACHE"] = str(Path(task_dir) / "datasets")
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        results = simple_evaluate(
            model="local-completions",
            model_args={"base_url": f"{base_url}/completions", "model": model, "tokenizer": checkpoint_dir,
                        "tokenizer_backend": "huggingface", "max_retries": 1},
            tasks=[TASK], task_manager=TaskManager(include_path=task_dir), log_samples=True,
            bootstrap_iters=0)  # no stderr resampling: the test reads the values only
    scored = [{"doc_id": sample["doc_id"], "context": args[0], "continuation": args[1], "loglikelihood": resp[0]}
              for sample in results["samples"][TASK]
              for args, resp in zip(sample["arguments"], sample["filtered_resps"], strict=True)]
    print(json.dumps({"acc": results["results"][TASK]["acc,none"], "scored": scored}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
