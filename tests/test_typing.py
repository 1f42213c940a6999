"""Typing (issue 27, part 3): ``mypy --strict`` over the package and the
adapters with the project's config (pyproject.toml, [tool.mypy]), and the
compiled modules' stubs (python/phx/_lib/*.pyi) against the modules
themselves: mypy's stubtest, plus the constructors, which stubtest cannot
see (a cdef class's ``__cinit__`` has no signature at run time).  Skips only
where mypy is not installed (``make test`` installs it).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mypy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "python", "phx", "_lib")
MODULES = ("engine", "cuda", "nvme", "devmem")


def _run(args: list[str], cwd: str = ROOT, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)


def test_mypy_strict():
    """The package and the adapters' Python, strict (the files, the untyped
    frameworks and the cache folder build/mypy come from pyproject.toml)."""
    r = _run(["mypy"])
    assert r.returncode == 0, r.stdout + r.stderr


def test_stubs_match_the_compiled_modules():
    """Every public name of each compiled module and class is in its stub with
    the runtime's signature, and nothing is in a stub that the module lacks.
    tests/stubtest-allowlist.txt has the few things a stub cannot say, each
    with its reason."""
    args = ["mypy.stubtest", "--mypy-config-file", "pyproject.toml",
            "--allowlist", os.path.join("tests", "stubtest-allowlist.txt")]
    if sys.version_info >= (3, 12):
        args.append("--ignore-unused-allowlist")   # __buffer__ exists there
    r = _run(args + [f"phx._lib.{m}" for m in MODULES])
    assert r.returncode == 0, r.stdout + r.stderr


# -- constructors: __cinit__ in the .pyx against __new__ in the .pyi -----------

def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _pyx_constructors(path: str) -> dict[str, list[tuple[str, bool, object]]]:
    """{class: [(name, keyword-only, default or ...)]} of every ``__cinit__``."""
    src = open(path).read()
    out: dict[str, list[tuple[str, bool, object]]] = {}
    for m in re.finditer(r"^cdef class (\w+)", src, re.M):
        end = src.find("\ncdef class ", m.end())
        body = src[m.end():end if end >= 0 else len(src)]
        c = re.search(r"def __cinit__\(self,?(.*?)\):", body, re.S)
        if c is None:
            continue
        params, kwonly = [], False
        for p in _split_params(c.group(1)):
            if p == "*":
                kwonly = True
                continue
            decl, _, default = p.partition("=")
            name = decl.split()[-1]                 # "bint direct" -> "direct"
            params.append((name, kwonly,
                           ast.literal_eval(default.strip()) if default else ...))
        out[m.group(1)] = params
    return out


def _stub_constructors(path: str) -> dict[str, list[tuple[str, bool, object]]]:
    out: dict[str, list[tuple[str, bool, object]]] = {}
    for node in ast.parse(open(path).read()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for f in node.body:
            if isinstance(f, ast.FunctionDef) and f.name == "__new__":
                a = f.args
                pos = a.posonlyargs + a.args
                defaults = [...] * (len(pos) - len(a.defaults)) + [
                    ast.literal_eval(d) for d in a.defaults]
                params = [(p.arg, False, d) for p, d in zip(pos, defaults)][1:]   # cls
                params += [(p.arg, True, ... if d is None else ast.literal_eval(d))
                           for p, d in zip(a.kwonlyargs, a.kw_defaults)]
                out[node.name] = params
    return out


@pytest.mark.parametrize("module", MODULES)
def test_stub_constructors_match_cinit(module):
    """Each cdef class's ``__cinit__`` arguments (names, order, keyword-only,
    defaults) are its stub's ``__new__``; a class without one has none."""
    pyx = _pyx_constructors(os.path.join(LIB, f"{module}.pyx"))
    pyi = _stub_constructors(os.path.join(LIB, f"{module}.pyi"))
    assert pyx == pyi


def test_the_constructor_check_sees_a_difference():
    """The parser above is not vacuous: a changed argument is noticed."""
    pyx = _pyx_constructors(os.path.join(LIB, "engine.pyx"))
    assert [n for n, _, _ in pyx["File"]] == ["engine", "path", "mode", "direct",
                                               "allow_buffered"]
    assert ("submit_batch", True, None) in pyx["Engine"]


# -- what an installed phx gives its users' type checkers ----------------------

def test_the_installed_package_is_typed(tmp_path):
    """phx as imported (the editable install here, a wheel elsewhere) carries
    py.typed and the compiled modules' stubs, and a user's mypy, run outside
    this tree without its config, finds them: typed results, not Any."""
    spec = importlib.util.find_spec("phx")
    assert spec is not None and spec.origin is not None
    pkg = os.path.dirname(spec.origin)
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    for m in MODULES:
        assert os.path.exists(os.path.join(pkg, "_lib", f"{m}.pyi")), m
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent("""
        import phx
        with phx.open("x", "r") as f:
            reveal_type(f.pread(bytearray(4096), 0))
            reveal_type(f.alignment)
        reveal_type(phx.empty_aligned(4096).address)
    """))
    r = _run(["mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
              "--cache-dir", os.path.join(ROOT, "build", "mypy-user"), str(user)],
             cwd=str(tmp_path))
    out = (r.stdout + r.stderr).replace("builtins.", "")    # older mypy spells it out
    assert re.findall(r'Revealed type is "([^"]+)"', out) == ["int", "tuple[int, int]", "int"], out
    assert "error:" not in out, out
