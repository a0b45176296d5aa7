"""pip's way to build the kvstash package: `pip install --no-build-isolation ./python`.

The extension is built by the project's CMake (the same target as a normal build,
kvstash_python), offline, with Debian's libraries; the pure-Python modules are copied as they
are. Set KVSTASH_CMAKE_BUILD_DIR to reuse a configured build tree; otherwise one is made under
setuptools' build_temp. CMake, Ninja and the -dev packages of scripts/lib/setup.sh must be
installed.
"""

import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if not (ROOT / "CMakeLists.txt").exists():
            raise RuntimeError(f"kvstash: {ROOT} is not the kvstash source tree; install from "
                               "a clone (pip install --no-build-isolation ./python)")
        build_dir = pathlib.Path(os.environ.get("KVSTASH_CMAKE_BUILD_DIR")
                                 or pathlib.Path(self.build_temp).resolve() / "cmake")
        build_dir.mkdir(parents=True, exist_ok=True)
        output = build_dir / "python"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
            "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG",
            "-DKVSTASH_BUILD_PYTHON=ON", f"-DKVSTASH_PYTHON_EXECUTABLE={sys.executable}",
            "-DKVSTASH_BUILD_TESTS=OFF", "-DKVSTASH_BUILD_BENCHMARKS=OFF",
        ]
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "kvstash_python",
                        "--parallel", str(os.cpu_count() or 2)], check=True)
        built = sorted((output / "kvstash").glob("_kvstash*.so"))
        if not built:
            raise RuntimeError(f"kvstash: the build made no extension in {output / 'kvstash'}")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[-1], target)


setup(
    name="kvstash",
    version="0.1.0",
    description="Client of kvstash KV-cache offload nodes, and a vLLM secondary tier",
    packages=["kvstash"],
    ext_modules=[CMakeExtension("kvstash._kvstash")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    entry_points={"vllm.general_plugins": ["kvstash = kvstash.vllm:register"]},
    zip_safe=False,
)
