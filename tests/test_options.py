"""Options of the wrong type or a misspelled name fail with an error that names the option and what it takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helion_backend.options import BackendOptions


@pytest.mark.parametrize("options, error, message", [
    ({"rules": 3}, TypeError, "option 'rules' must be a path or a list of paths to rule files (TOML), got 3"),
    ({"rules": ["a.toml", None]}, TypeError, "option 'rules' must be a path or a list of paths"),
    ({"cache_dir": 5}, TypeError, "option 'cache_dir' must be a path to a folder (str or os.PathLike), got 5"),
    ({"cache_dir": None}, TypeError, "option 'cache_dir' must be a path to a folder"),
    ({"debug_dir": ["out"]}, TypeError, "option 'debug_dir' must be a path to a folder (str or os.PathLike), "
                                        "got ['out']"),
    ({"inductor_config": [("max_autotune", True)]}, TypeError,
     "option 'inductor_config' must be a dict of torch._inductor.config names to values"),
    ({"inductor_config": {1: True}}, TypeError, "option 'inductor_config' must be a dict"),
    ({"rule": ["a.toml"]}, ValueError, "unknown option(s) 'rule' (did you mean 'rules'?); valid options are"),
    ({"max_helion_sizes": 8, "bogus": 1}, ValueError,
     "unknown option(s) 'bogus', 'max_helion_sizes' (did you mean 'max_helion_size'?)"),
])
def test_a_wrong_option_names_itself_and_what_it_takes(options, error, message):
    with pytest.raises(error) as info:
        BackendOptions.from_user(options)
    assert message in str(info.value)


def test_the_same_error_reaches_the_user_of_torch_compile():
    compiled = torch.compile(lambda x: x @ x, backend="helion_inductor", options={"debug_dirr": "/tmp"})
    with pytest.raises(Exception, match=r"unknown option\(s\) 'debug_dirr' \(did you mean 'debug_dir'\?\)"):
        compiled(torch.randn(4, 4))


def test_paths_may_be_path_objects(tmp_path):
    made = BackendOptions.from_user({"rules": tmp_path / "r.toml", "cache_dir": tmp_path, "debug_dir": None,
                                     "inductor_config": {"max_autotune": False}})
    assert made.rules == (str(tmp_path / "r.toml"),) and made.cache_dir == str(tmp_path)
    assert made.debug_dir is None and made.inductor_config == {"max_autotune": False}
    assert BackendOptions.from_user({"debug_dir": Path("out")}).debug_dir == "out"
