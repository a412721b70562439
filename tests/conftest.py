"""Session-wide test setup shared by every test package."""

import os

# Nothing may be fetched from a model hub: every checkpoint is made locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

# Fixed thread count: results must not depend on the machine's core count.
torch.set_num_threads(2)


# Figures a test records for the run's log (`record_property`), printed after the summary: a
# passing test's output is not shown, and these are what a run is judged by beside pass/fail.
REPORTED_PROPERTIES = {"worst_lease_renewal_delay_s": "worst lease renewal delay (s)"}


def pytest_terminal_summary(terminalreporter) -> None:
    for report in terminalreporter.stats.get("passed", []):
        for name, value in report.user_properties:
            if name in REPORTED_PROPERTIES:
                terminalreporter.write_line(f"{REPORTED_PROPERTIES[name]}: {value} ({report.nodeid})")
