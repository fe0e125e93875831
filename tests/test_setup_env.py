"""scripts/setup_env.sh: the main job's set-up builds no torch oracle, and re-running it installs nothing.

The script runs for real in a scratch copy of the repository root, with a stand-in Python that records
every call (creating a venv makes a copy of the stand-in; pip marks the venv installed)."""

import os
import pathlib
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).parents[1]

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$0 $*" >> "$FAKE_LOG"
venv="$(cd "$(dirname "$0")/.." && pwd)"
case "$1 $2" in
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
  "-m pip") touch "$venv/installed" ;;
  "-c import sys; sys.exit(sys.version_info"*) exit 0 ;;  # the set-up's version check: any version will do
  *) [ "$1" = "-c" ] && exec test -e "$venv/installed" ;;
esac
"""


@pytest.fixture
def sandbox(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup_env.sh", tmp_path / "scripts")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    env = dict(os.environ, PY312=str(fake), PY311=str(fake), FAKE_LOG=str(log))

    def setup(*flags):
        log.write_text("")
        subprocess.run(["bash", "scripts/setup_env.sh", *flags], cwd=tmp_path, env=env, check=True,
                       capture_output=True, text=True)
        return log.read_text().splitlines()

    return tmp_path, setup


def pip_installs(calls, venv):
    return [c for c in calls if c.split("/bin/python ")[0].endswith(venv) and " -m pip install" in c]


def test_main_job_setup_builds_no_oracle_and_reruns_install_nothing(sandbox):
    root, setup = sandbox
    calls = setup()
    assert len(pip_installs(calls, ".venv")) == 1 and not (root / ".venv-ref").exists()
    assert not pip_installs(setup(), ".venv"), "re-running the set-up reinstalled .venv"


def test_oracle_only_with_the_flag_and_once(sandbox):
    root, setup = sandbox
    calls = setup("--with-oracle")
    assert len(pip_installs(calls, ".venv-ref")) == 1 and (root / ".venv-ref" / "bin" / "python").exists()
    again = setup("--with-oracle")
    assert not pip_installs(again, ".venv") and not pip_installs(again, ".venv-ref")


def test_extras_change_reinstalls(sandbox):
    _, setup = sandbox
    setup()
    calls = setup("--gpu")
    assert len(pip_installs(calls, ".venv")) == 1 and "[test,gpu]" in pip_installs(calls, ".venv")[0]


def _bare_path(tmp_path, programs: dict | None = None) -> dict:
    """An environment whose PATH holds what the script needs besides Python, plus ``programs`` (name: script)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "cat", "cksum", "grep", "sort", "tail", "mkdir", "cp", "touch", "test"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    for name, text in (programs or {}).items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PY312", "PY311", "PYENV_VERSION")}
    return dict(env, PATH=str(bin_dir), FAKE_LOG=str(tmp_path / "calls.log"))


def _setup_in(tmp_path, env):
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(REPO / "scripts" / "setup_env.sh", tmp_path / "scripts")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return subprocess.run([shutil.which("bash"), "scripts/setup_env.sh"], cwd=tmp_path, env=env, capture_output=True,
                          text=True)


NOT_FOUND = ("setup_env.sh: no Python 3.12 found: install it (python3.12 on the PATH), or set "
             "PY312=/path/to/python3.12\n")


def test_python_comes_from_the_path_or_the_variable_never_one_users_home(tmp_path):
    """The script defaulted to a pyenv path under one user's home; now python3.12 on the PATH (or PY312), and where
    there is none, one line saying what to install or set (before creating anything)."""
    script = (REPO / "scripts" / "setup_env.sh").read_text()
    assert "/root/" not in script and ".pyenv" not in script and "/home/" not in script
    run = _setup_in(tmp_path, _bare_path(tmp_path))
    assert run.returncode == 2 and not (tmp_path / ".venv").exists() and run.stderr == NOT_FOUND, run.stderr


def test_a_pyenv_shim_that_does_not_run_falls_back_to_pyenvs_own_312(tmp_path):
    """On a machine whose python3.12 is a pyenv shim with another version selected (it answers 'command not found'),
    the set-up takes the newest 3.12 pyenv has installed; with no pyenv, the one line above."""
    shim = "#!/usr/bin/env bash\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n"
    fake = str(tmp_path / "fake-python")
    (tmp_path / "fake-python").write_text(FAKE_PYTHON)
    (tmp_path / "fake-python").chmod(0o755)
    pyenv = ("#!/usr/bin/env bash\n"
             'case "$1" in\n'
             '  versions) printf "3.11.7\\n3.12.1\\n3.12.10\\n3.13.0\\n" ;;\n'
             f'  which) [ "$PYENV_VERSION" = 3.12.10 ] && echo {fake} ;;\n'
             "esac\n")
    lone = tmp_path / "lone"
    lone.mkdir()
    run = _setup_in(lone, _bare_path(lone, {"python3.12": shim}))
    assert run.returncode == 2 and run.stderr == NOT_FOUND, run.stderr
    with_pyenv = tmp_path / "with_pyenv"
    with_pyenv.mkdir()
    run = _setup_in(with_pyenv, _bare_path(with_pyenv, {"python3.12": shim, "pyenv": pyenv}))
    assert f"[setup] creating .venv with {fake}" in run.stdout, (run.stdout, run.stderr)
