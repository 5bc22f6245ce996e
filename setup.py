"""Ships `exactlogp-autopatch.pth` into site-packages (the rest is in pyproject.toml).

The .pth runs the EXACTLOGP_PATCH start-up hook (`src/_exactlogp_autopatch`). setuptools
has no declarative way to put a file at the top of site-packages, so build_py copies it:
into build_lib for a wheel, and for `pip install -e` (PEP 660) into the editable wheel's
own root, which setuptools installs into site-packages next to its `__editable__` .pth.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "exactlogp-autopatch.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        source = Path(__file__).parent / "src" / PTH
        if self.editable_mode:
            # editable_wheel points install_lib at the unpacked editable wheel
            target = Path(self.get_finalized_command("install").install_lib)
        else:
            target = Path(self.build_lib)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target / PTH)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
