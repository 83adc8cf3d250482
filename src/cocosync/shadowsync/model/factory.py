"""Which model a run trains: a built-in by name (`BUILTINS`) or the user's factory as `package.module:function` (or
`path/to/file.py:function`), importable by every rank; `build_model` calls it with the run's `ModelInputs`, seeded,
so that every rank builds the same initial model. A factory in a script is loaded by file in every rank, as
multiprocessing's spawn loads a script: what the script runs must be under `if __name__ == "__main__":`."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from cocosync.shadowsync.errors import ConfigError
from cocosync.shadowsync.model.dcn import DCN
from cocosync.shadowsync.model.deepfm import DeepFM
from cocosync.shadowsync.model.dlrm import DLRM
from cocosync.shadowsync.model.inputs import ModelInputs

__all__ = ["BUILTINS", "Factory", "resolve_factory", "factory_spec", "build_model"]

Factory = Callable[[ModelInputs], nn.Module]
_FILE_MODULE = "cocosync_model_file_"  # the module name a factory's file is loaded under

#: the built-in models by name
BUILTINS: dict[str, Factory] = {"dlrm": DLRM, "dcn": DCN, "deepfm": DeepFM}


def resolve_factory(spec: str) -> Factory:
    """The factory named by `spec`: a built-in's name, `package.module:function` or `file.py:function`."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"model={spec!r}: expected a built-in ({', '.join(BUILTINS)}), 'package.module:function' "
                          "or 'path/to/file.py:function'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"model={spec!r}: no such file {where!r}")
        mod_name = f"{_FILE_MODULE}{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[mod_name] = module
            loader.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(f"model={spec!r}: cannot import {where!r} ({e}); it must be importable by every rank "
                              "(installed, or on PYTHONPATH)") from None
    factory = module
    for part in name.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ConfigError(f"model={spec!r}: {where!r} has no {name!r}")
    if not callable(factory):
        raise ConfigError(f"model={spec!r}: {name!r} is a {type(factory).__name__}, not a callable")
    return factory


def factory_spec(factory: Factory | str) -> str:
    """The spec of a factory every rank can resolve: a built-in's name, its module path, or its file's path."""
    if isinstance(factory, str):
        resolve_factory(factory)
        return factory
    for name, f in BUILTINS.items():
        if f is factory:
            return name
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or "<" in qualname:
        raise ConfigError(f"model factory {factory!r} must be defined at the top level of a module (not a lambda or "
                          "a nested function): every rank imports it")
    if module == "__main__" or module.startswith(_FILE_MODULE):
        file = inspect.getsourcefile(factory)
        if file is None:
            raise ConfigError(f"model factory {qualname!r} is in __main__ without a file: define it in a module")
        return f"{Path(file).resolve()}:{qualname}"
    return f"{module}:{qualname}"


def build_model(spec: str, inputs: ModelInputs) -> nn.Module:
    """The model of `spec` for `inputs`, its random initialization drawn from `inputs.config.seed` (the same on
    every rank); ConfigError when the factory fails or returns no module."""
    factory = resolve_factory(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(inputs.config.seed)
        try:
            model = factory(inputs)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"model={spec!r} cannot be built for this data: {e}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={spec!r} returned a {type(model).__name__}, expected a torch.nn.Module")
    return model
