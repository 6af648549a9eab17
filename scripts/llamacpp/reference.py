"""What the Python scripts that use llama.cpp share: where scripts/build-llamacpp
keeps its build and the llama.cpp source, where the test models live, the
provenance recorded in golden vectors, and the project's pinned Python.

Used by scripts/golden-llamacpp, scripts/make-models and scripts/golden-models
(which put this folder on sys.path). Standard library only: it must import
before the pinned virtual environment is in use.
"""
import hashlib
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")

# The llama-cpp-python source distribution scripts/build-llamacpp builds from.
VERSION = os.environ.get("INFERD_LLAMACPP_PY_VERSION", "0.3.36")
CACHE = os.environ.get("INFERD_LLAMACPP_DIR", os.path.join(os.path.expanduser("~"), ".cache", "inferd", "llamacpp"))
SDIST = os.path.join(CACHE, f"llama_cpp_python-{VERSION}.tar.gz")
SRC = os.path.join(CACHE, "src", f"llama_cpp_python-{VERSION}", "vendor", "llama.cpp")
GGUF_PY = os.path.join(SRC, "gguf-py")


def models_dir():
    """Where scripts/make-models writes the random-weight models (never committed)."""
    return os.environ.get("INFERD_MODELS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "inferd", "models"))


def vocab_dir():
    """Where scripts/fetch-vocabs puts llama.cpp's vocabulary-only GGUF files."""
    return os.environ.get("INFERD_VOCAB_DIR", os.path.join(os.path.expanduser("~"), ".cache", "inferd", "vocabs"))


def log(prog, *args):
    print(f"{prog}:", *args, file=sys.stderr, flush=True)


def run(cmd, **kw):
    """Runs cmd, fails on a non-zero exit, returns its stdout as text."""
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, **kw).stdout


def last_line(text):
    return text.strip().splitlines()[-1]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_llamacpp(*targets, only_lib=False):
    """Builds llama.cpp (scripts/build-llamacpp, idempotent) and returns its bin
    directory; INFERD_LLAMACPP_BIN names an already built one instead."""
    if os.environ.get("INFERD_LLAMACPP_BIN"):
        return os.environ["INFERD_LLAMACPP_BIN"]
    env = dict(os.environ)
    if only_lib:
        env["INFERD_LLAMACPP_ONLY_LIB"] = "1"
    return last_line(run([os.path.join(SCRIPTS, "build-llamacpp"), *targets], env=env))


def source_info():
    """Provenance of the llama.cpp build, as recorded in the golden vectors."""
    commit = None
    changelog = os.path.join(CACHE, "src", f"llama_cpp_python-{VERSION}", "CHANGELOG.md")
    with open(changelog, encoding="utf-8") as f:
        section = f.read().split(f"## [{VERSION}]", 1)[-1]
        m = re.search(r"llama\.cpp@([0-9a-f]+)", section)
        commit = m.group(1) if m else None
    return {
        "llama_cpp_python_sdist": f"llama-cpp-python=={VERSION}",
        "sdist_sha256": sha256(SDIST),
        "llama_cpp_commit": commit,
        "built_with": "scripts/build-llamacpp (cmake Release, GGML_NATIVE=ON, CPU only)",
        "tool": "scripts/llamacpp/golden.c (llama.h API)",
    }


def use_project_python(prog):
    """Re-runs the calling script under the project's pinned virtual
    environment (scripts/python-env: numpy, PyYAML, ...) unless it already
    runs there."""
    python = os.environ.get("INFERD_PYENV_PYTHON")
    if not python:
        python = last_line(run([os.path.join(SCRIPTS, "python-env")]))
        os.environ["INFERD_PYENV_PYTHON"] = python
    venv = os.path.dirname(os.path.dirname(python))
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):
        return
    os.execv(python, [python, os.path.abspath(sys.argv[0]), *sys.argv[1:]])


def import_gguf():
    """llama.cpp's own gguf-py, from the source scripts/build-llamacpp unpacked."""
    if not os.path.isdir(GGUF_PY):
        raise SystemExit(f"llama.cpp's gguf-py is not at {GGUF_PY}; run scripts/build-llamacpp")
    sys.path.insert(0, GGUF_PY)
    import gguf  # noqa: E402

    return gguf
