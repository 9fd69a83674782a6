"""Build script for diffusiongemma.

The repository keeps one top-level folder per concept; they install under a single import
namespace so that nothing called ``reference`` or ``fast`` lands at the top of site-packages:

    diffusiongemma/    -> diffusiongemma            (package root: checkpoints, tokenizer, command line,
                                                 golden traces, the shipped model)
    reference/         -> diffusiongemma.reference  (pure-NumPy specification)
    fast/              -> diffusiongemma.fast       (Cython/OpenMP CPU kernels; fast/gpu: CuPy + CUDA)
    weights_converter/ -> diffusiongemma.weights_converter

Cython extensions are compiled with OpenMP when the compiler accepts ``-fopenmp`` and serially
otherwise (the kernels guard their ``prange`` loops, so both builds compute the same numbers).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from glob import glob

from setuptools import setup
from setuptools.command.build_ext import build_ext

PACKAGE_DIRS = {
    "diffusiongemma": "diffusiongemma",
    "diffusiongemma.cli": "diffusiongemma/cli",
    "diffusiongemma.trace": "diffusiongemma/trace",
    "diffusiongemma.crosscheck": "diffusiongemma/crosscheck",
    "diffusiongemma.reference": "reference",
    "diffusiongemma.fast": "fast",
    "diffusiongemma.fast.gpu": "fast/gpu",
    "diffusiongemma.weights_converter": "weights_converter",
}


def _compiler_has_openmp() -> bool:
    """True when the C compiler builds and links a tiny OpenMP program."""
    if os.environ.get("DIFFUSIONGEMMA_NO_OPENMP"):
        return False
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        result = subprocess.run([cc, "-fopenmp", src, "-o", os.path.join(tmp, "omp")],
                                capture_output=True)
        return result.returncode == 0


def _extensions():
    pyx_files = sorted(glob(os.path.join("fast", "*.pyx")))
    if not pyx_files:
        return []
    import numpy
    from Cython.Build import cythonize
    from setuptools import Extension

    openmp = _compiler_has_openmp()
    compile_args = ["-O3", "-ffp-contract=off"] + (["-fopenmp"] if openmp else [])
    link_args = ["-fopenmp"] if openmp else []
    extensions = [
        Extension(
            "diffusiongemma.fast." + os.path.splitext(os.path.basename(path))[0],
            [path],
            include_dirs=[numpy.get_include(), "fast"],  # fast/panel_gemm.h
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        )
        for path in pyx_files
    ]
    print(f"diffusiongemma: building {len(extensions)} Cython extension(s), OpenMP={'on' if openmp else 'off'}",
          file=sys.stderr)
    return cythonize(extensions, language_level=3,
                     compile_time_env={"HAVE_OPENMP": openmp},
                     compiler_directives={"boundscheck": False, "wraparound": False,
                                          "cdivision": True, "initializedcheck": False})


# ---------------------------------------------------------------------------------------------------------
# cuda-sim: the CPU executor of the CUDA kernels (fast/gpu/sim/). Two plain shared libraries, loaded with
# ctypes by fast/gpu/sim.py (never imported as Python modules): the executor (_sim_runtime), and the kernel
# sources of fast/gpu/cuda compiled with cuda_sim.h (_sim_kernels; -fsanitize=thread at compile time only:
# the executor answers its per-access calls, its run-time library is never linked). The kernel unit is
# generated into build/ by fast/gpu/sim/codegen.py; a stale build is detected by hash at load time and
# rebuilt at run time, so editing a .cu never runs old code. DIFFUSIONGEMMA_NO_CUDA_SIM=1 skips both.
def _sim_extensions():
    if os.environ.get("DIFFUSIONGEMMA_NO_CUDA_SIM") or sys.platform != "linux":
        return []
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        print("diffusiongemma: no C++ compiler, cuda-sim not built (device='cuda-sim' will say so)", file=sys.stderr)
        return []
    import hashlib
    import importlib.util

    from setuptools import Extension

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module

    codegen = load("dg_sim_codegen", os.path.join("fast", "gpu", "sim", "codegen.py"))
    launch = load("dg_sim_launch", os.path.join("fast", "gpu", "launch.py"))
    os.makedirs(os.path.join("build", "dg_sim"), exist_ok=True)
    unit = os.path.join("build", "dg_sim", "kernels_sim.cpp")
    text = codegen.directory_unit(os.path.join("fast", "gpu", "cuda"), launch.signatures(os.path.join("fast", "gpu", "cuda")))
    if not os.path.exists(unit) or open(unit, encoding="utf-8").read() != text:
        with open(unit, "w", encoding="utf-8") as f:
            f.write(text)
    with open(codegen.RUNTIME, "rb") as f:
        runtime_hash = hashlib.sha256(f.read()).hexdigest()[:16]
    return [
        Extension("diffusiongemma.fast.gpu._sim_runtime", [codegen.RUNTIME], language="c++",
                  extra_compile_args=list(codegen.RUNTIME_FLAGS),
                  define_macros=[("DG_SIM_RUNTIME_HASH", f'"{runtime_hash}"')]),
        Extension("diffusiongemma.fast.gpu._sim_kernels", [unit], language="c++",
                  extra_compile_args=list(codegen.KERNEL_FLAGS)),
    ]
# ---------------------------------------------------------------------------------------------------------


setup(
    name="diffusiongemma",
    version="0.1.0",
    description="Executable specification of Google's DiffusionGemma: a NumPy reference, "
                "compiled fast paths and a weights converter",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    package_dir=PACKAGE_DIRS,
    packages=list(PACKAGE_DIRS),
    package_data={
        "diffusiongemma.fast": ["*.pyx", "*.pxd", "*.h"],
        "diffusiongemma.fast.gpu": ["cuda/*.cu", "cuda/*.cuh", "sim/*.h", "sim/*.cpp", "sim/*.py"],
        "diffusiongemma": ["assets/*", "assets/*/*"],
    },
    ext_modules=_extensions() + _sim_extensions(),
    cmdclass={"build_ext": build_ext},
    install_requires=[
        "numpy>=1.26",
        "ml_dtypes>=0.4",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "tqdm>=4.60",
        "jinja2>=3.0",
        "threadpoolctl>=3.1",
        "gguf>=0.17",  # reading llama.cpp GGUF checkpoints (weights_converter/gguf.py)
    ],
    extras_require={
        "test": [
            "pytest>=7.3",  # tmp_path_retention_policy (pyproject.toml)
            "pytest-randomly>=3.15",  # every run in a random order, its seed printed (-p randomly --randomly-seed=N replays it)
            "hypothesis>=6.80",
            "torch==2.13.0",
            "transformers==5.24.0",
            "matplotlib>=3.7",  # tests/test_plot.py draws every figure of `diffusiongemma plot`
            "diffusers>=0.42.1",  # tests/test_crosscheck.py (clean install measured at 2.4 min on 2 cores)
            # NVRTC (a plain library: no toolkit, driver or GPU) for tests/test_gpu_compile.py, 90 MB
            "nvidia-cuda-nvrtc-cu12>=12.4; sys_platform == 'linux' and "
            "(platform_machine == 'x86_64' or platform_machine == 'aarch64')",
        ],
        "plot": ["matplotlib>=3.7"],  # diffusiongemma plot (pictures of the denoising)
        "mlx": ["mlx[cpu]>=0.32.4; sys_platform == 'linux'", "mlx>=0.32.4; sys_platform == 'darwin'",
                "mlx-vlm>=0.7.10", "torch==2.13.0", "transformers==5.24.0"],  # crosscheck mlx-vlm (venv 1.9 GB, 3.9 min)
        "diffusers": ["diffusers>=0.42.1", "torch==2.13.0", "transformers==5.24.0"],  # crosscheck diffusers
        "jax": ["jax[cpu]>=0.5"],  # tests/test_jax_draws.py checks JaxDraws against jax.random (threefry partitionable)
        "gpu": ["cupy-cuda12x>=13"],  # CUDA 12 drivers
        "gpu-cuda13": ["cupy-cuda13x>=14"],  # CUDA 13 drivers
    },
    entry_points={
        "console_scripts": [
            "diffusiongemma = diffusiongemma.cli.main:main",
            "diffusiongemma-convert = diffusiongemma.weights_converter.cli:main",
        ],
        # file formats the reference's loader reads through the converter (reference/weights.py)
        "diffusiongemma.checkpoint_readers": [
            "transformers = diffusiongemma.weights_converter:TRANSFORMERS_READER",
            "gguf = diffusiongemma.weights_converter:GGUF_READER",
        ],
    },
    zip_safe=False,
)
