"""The EXACTLOGP_PATCH start-up hook: `exactlogp-autopatch.pth` (installed in site-packages
with the package) runs `_exactlogp_autopatch.startup()`, which patches a named host right
after it is first imported. Each case runs in a spawned interpreter with this checkout's
src first on PYTHONPATH and the .pth line run by `-c` (the .pth of this checkout may not be
installed in the test environment); `test_the_wheel_ships_the_pth` checks that it is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PTH = ROOT / "src" / "exactlogp-autopatch.pth"
# no finder of the hook in sys.meta_path: nothing can patch a host when it is imported
NO_FINDER = (
    "import sys; assert not any(type(f).__module__.startswith('_exactlogp_autopatch') "
    "for f in sys.meta_path), sys.meta_path; print('NO FINDER')"
)
PATCHED = (
    "import trl.trainer.utils as u, exactlogp.integrations.trl as x; "
    "print('PATCHED' if u.selective_log_softmax is x.selective_log_softmax else 'PLAIN')"
)


def _run(code: str, env_patch: str | None, **extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXACTLOGP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if env_patch is not None:
        env["EXACTLOGP_PATCH"] = env_patch
    env.update(extra)
    startup = PTH.read_text().strip()
    return subprocess.run(
        [sys.executable, "-c", f"{startup}\n{code}"],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_the_pth_line_is_one_guarded_import():
    lines = PTH.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import ")
    assert 'os.environ.get("EXACTLOGP_PATCH") and' in lines[0]


def test_trl_is_patched_when_imported():
    code = (
        "import sys; assert 'trl' not in sys.modules and 'torch' not in sys.modules; "
        "import trl; " + PATCHED
    )
    done = _run(code, "trl")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "PATCHED"


def test_a_host_imported_before_the_hook_is_patched_at_once():
    done = _run(
        "import trl; import _exactlogp_autopatch as h; h.uninstall(); h.install(); " + PATCHED,
        "trl",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "PATCHED"


def test_nothing_happens_without_the_variable():
    done = _run("import sys; assert '_exactlogp_autopatch' not in sys.modules; " + NO_FINDER, None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "NO FINDER"


def test_vllm_is_left_to_its_plugin_and_nothing_is_imported():
    code = (
        "import sys; print(sorted(m for m in ('vllm', 'sglang', 'torch', 'exactlogp', 'trl') "
        "if m in sys.modules), len(sys.meta_path))"
    )
    bare = subprocess.run(
        [sys.executable, "-c", "import sys; print(len(sys.meta_path))"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    done = _run(code, "vllm,sglang")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", bare.stdout.strip()]  # no finder either


@pytest.mark.parametrize(
    ("value", "vocab", "named"),
    [
        ("trl,bogus", None, "EXACTLOGP_PATCH='trl,bogus' names unknown hosts ['bogus']"),
        ("trl", "12x", "EXACTLOGP_VOCAB_SIZE='12x' is not a vocabulary size"),
    ],
)
def test_a_bad_value_warns_and_patches_nothing(value, vocab, named):
    extra = {} if vocab is None else {"EXACTLOGP_VOCAB_SIZE": vocab}
    done = _run(NO_FINDER, value, **extra)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "NO FINDER"
    assert "RuntimeWarning" in done.stderr and named in done.stderr
    assert "nothing is patched" in done.stderr


def test_a_patch_that_fails_raises_from_the_import(tmp_path):
    """A named host whose patch cannot be applied fails its import, naming the variable."""
    (tmp_path / "trl").mkdir()
    (tmp_path / "trl" / "__init__.py").write_text("")  # a "trl" without trl.trainer.utils
    done = _run("import trl", "trl", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(tmp_path)]))
    assert done.returncode != 0
    assert "EXACTLOGP_PATCH='trl': patching trl when it was imported failed" in done.stderr


def test_the_wheel_ships_the_pth(tmp_path):
    """`pip wheel` of a copy of the project: the .pth sits at the wheel's root (so in
    site-packages), next to the hook package. `pip install -e` puts it there too: setup.py."""
    pytest.importorskip("setuptools")
    source = tmp_path / "project"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if built.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {built.stderr[-500:]}")
    (wheel,) = (tmp_path / "dist").glob("exactlogp-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert "exactlogp-autopatch.pth" in names
        assert "_exactlogp_autopatch/__init__.py" in names
        assert archive.read("exactlogp-autopatch.pth").decode() == PTH.read_text()
