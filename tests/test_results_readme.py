"""results/README.md names every results file and nothing that is not there, and the documents' citations of
results files point at files that exist (run logs left the tree; they are cited at a commit, ``4bb7b34:results/...``)."""

import glob
import itertools
import pathlib
import re
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"


def expand(pattern: str) -> list[str]:
    """``a_{4k,8k}.{json,md}`` -> the four names (shell brace expansion, no nesting)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def listed() -> set[str]:
    """The files named in the first column of results/README.md's tables."""
    rows = [line for line in (RESULTS / "README.md").read_text().splitlines() if line.startswith("| `")]
    return {name for row in rows for pattern in re.findall(r"`([^`]+)`", row.split("|")[1]) for name in expand(pattern)}


def test_results_readme_names_only_files_that_exist():
    missing = sorted(name for name in listed() if not (RESULTS / name).is_file())
    assert not missing, f"results/README.md names files that are not there: {missing}"


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs the git checkout")
def test_every_committed_results_file_is_in_results_readme():
    files = subprocess.run(["git", "ls-files", "results"], cwd=REPO, capture_output=True, text=True, check=True)
    committed = {path.removeprefix("results/") for path in files.stdout.split()} - {"README.md"}
    assert committed, "git ls-files found no results"
    assert not sorted(committed - listed()), "results files missing from results/README.md"


@pytest.mark.parametrize("doc", ["README.md", "NOTES.md", "DESIGN.md"])
def test_cited_results_files_exist(doc):
    text = (REPO / doc).read_text()
    cited = {m.rstrip(".,;:") for m in re.findall(r"(?<![\w:/.-])results/[\w./{},*-]*[\w/*}]", text)}
    dangling = []
    for pattern in sorted(cited):  # the commands write into runs/: every cited results/ file is committed
        paths = [p for name in expand(pattern) for p in glob.glob(str(REPO / name))]
        if not paths:
            dangling.append(pattern)
    assert not dangling, f"{doc} cites results that are not there: {dangling}"
