"""Tests of the plugin loader ``slime_rc.plugins.load_function``."""

import os
import textwrap

import pytest

import custom_tis.icepop
import custom_tis.mis
import custom_tis.tis
from slime_rc.plugins import SHORT_NAMES, TIS_CONTRACT, PluginError, check_contract, load_function

FORMS_WORDS = ("pkg.mod.fn", "pkg.mod:fn", "path/file.py:fn", "mis", "tis", "icepop")


def write(path, source):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A temporary importable package ``plugpkg`` with a few modules; returns its root directory."""
    root = tmp_path / "site"
    write(root / "plugpkg" / "__init__.py", "")
    write(root / "plugpkg" / "good.py", """
        VALUE = 3

        def weights(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                    response_lengths):
            return "good.weights", args

        def compute_mis(args, **kwargs):
            return "good.compute_mis", kwargs

        def _private():
            pass

        class Corrector:
            @staticmethod
            def run(args, **kwargs):
                return "Corrector.run"
    """)
    write(root / "plugpkg" / "broken_dep.py", """
        import definitely_not_installed_dep_xyz

        def fn(args):
            return 1
    """)
    write(root / "plugpkg" / "raises.py", """
        raise RuntimeError("boom at import time")
    """)
    monkeypatch.syspath_prepend(str(root))
    yield root
    import sys
    for name in [m for m in sys.modules if m == "plugpkg" or m.startswith("plugpkg.")]:
        del sys.modules[name]


def error(spec, **kwargs):
    with pytest.raises(PluginError) as info:
        load_function(spec, **kwargs)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith(spec), message
    return info.value, message


# ---------------------------------------------------------------------------------------------------------------
# accepted forms


def test_dotted_and_colon_forms(pkg):
    import plugpkg.good
    assert load_function("plugpkg.good.weights") is plugpkg.good.weights
    assert load_function("plugpkg.good:weights") is plugpkg.good.weights
    assert load_function("  plugpkg.good:weights  ") is plugpkg.good.weights


def test_nested_attribute(pkg):
    import plugpkg.good
    fn = load_function("plugpkg.good:Corrector.run")
    assert fn is plugpkg.good.Corrector.run
    assert fn(None) == "Corrector.run"


def test_short_names_are_the_custom_tis_cp_functions():
    assert load_function("mis") is custom_tis.mis.compute_mis_weights_with_cp
    assert load_function("tis") is custom_tis.tis.compute_tis_weights_with_cp
    assert load_function("icepop") is custom_tis.icepop.compute_icepop_weights_with_cp
    assert set(SHORT_NAMES) == {"mis", "tis", "icepop"}


def test_file_form_relative_and_absolute(tmp_path, monkeypatch):
    write(tmp_path / "plugins" / "my_tis.py", """
        def fn(args, **kwargs):
            return ("my_tis", args)

        class Box:
            @classmethod
            def make(cls, args, **kwargs):
                return ("Box.make", args)
    """)
    absolute = load_function(f"{tmp_path / 'plugins' / 'my_tis.py'}:fn")
    assert absolute(7) == ("my_tis", 7)
    monkeypatch.chdir(tmp_path)
    relative = load_function("plugins/my_tis.py:fn")
    assert relative(8) == ("my_tis", 8)
    assert relative is absolute  # same file -> same module, not re-executed
    assert load_function("plugins/my_tis.py:Box.make")(9) == ("Box.make", 9)


def test_same_basename_in_two_folders_load_independently(tmp_path):
    a = write(tmp_path / "a" / "plugin.py", "NAME = 'a'\ndef fn(args):\n    return NAME\n")
    b = write(tmp_path / "b" / "plugin.py", "NAME = 'b'\ndef fn(args):\n    return NAME\n")
    fa, fb = load_function(f"{a}:fn"), load_function(f"{b}:fn")
    assert (fa(None), fb(None)) == ("a", "b")
    assert fa.__module__ != fb.__module__
    assert fa(None) == "a"  # loading b did not replace a


def test_file_with_dataclass_works(tmp_path):
    # dataclasses look their module up in sys.modules: the file must be registered while it executes
    path = write(tmp_path / "dc.py", """
        from dataclasses import dataclass

        @dataclass
        class Cfg:
            x: int = 1

        def fn(args):
            return Cfg(args).x
    """)
    assert load_function(f"{path}:fn")(5) == 5


# ---------------------------------------------------------------------------------------------------------------
# malformed specs


@pytest.mark.parametrize("spec", ["foo", ":fn", "mod:", "foo.py", "a/b.txt:fn", "pkg.mod:fn-x", "pkg..mod.fn",
                                  "pkg.mod.", "path/file.py.fn"])
def test_malformed_spec_lists_accepted_forms(spec):
    _, message = error(spec)
    assert "malformed" in message
    for word in FORMS_WORDS:
        assert word in message


def test_empty_and_non_string_spec():
    for spec in ("", "   "):
        with pytest.raises(PluginError, match="malformed") as info:
            load_function(spec)
        assert "pkg.mod:fn" in str(info.value)
    with pytest.raises(PluginError, match="must be a string"):
        load_function(None)


# ---------------------------------------------------------------------------------------------------------------
# module / file errors


def test_missing_module_dotted_form_says_what_it_tried(pkg):
    exc, message = error("plugpkg.nosuchmod.fn")
    assert "tried importing module 'plugpkg.nosuchmod'" in message
    assert "no module named 'plugpkg.nosuchmod'" in message
    assert isinstance(exc.__cause__, ModuleNotFoundError)


def test_missing_top_level_package_is_named():
    _, message = error("nosuch_pkg_xyz.mod:fn")
    assert "'nosuch_pkg_xyz.mod'" in message
    assert "no module named 'nosuch_pkg_xyz'" in message
    assert "was found" not in message


def test_import_error_inside_module_is_not_reported_as_module_not_found(pkg):
    for spec in ("plugpkg.broken_dep:fn", "plugpkg.broken_dep.fn"):
        exc, message = error(spec)
        assert "module 'plugpkg.broken_dep' was found but importing it failed" in message
        assert "definitely_not_installed_dep_xyz" in message  # the original error text
        assert "tried importing" not in message
        assert isinstance(exc.__cause__, ModuleNotFoundError)
        assert exc.__cause__.name == "definitely_not_installed_dep_xyz"


def test_other_exception_at_import_time_is_chained(pkg):
    exc, message = error("plugpkg.raises:fn")
    assert "was found but importing it failed" in message
    assert "RuntimeError: boom at import time" in message
    assert isinstance(exc.__cause__, RuntimeError)


def test_missing_file_names_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, message = error("sub/missing.py:fn")
    assert os.path.join(str(tmp_path), "sub", "missing.py") in message
    assert "not found" in message


def test_file_that_fails_to_import(tmp_path):
    path = write(tmp_path / "bad.py", "import definitely_not_installed_dep_xyz\n")
    exc, message = error(f"{path}:fn")
    assert "was found but importing it failed" in message
    assert "definitely_not_installed_dep_xyz" in message
    assert isinstance(exc.__cause__, ImportError)
    # a fixed file loads afterwards: the failed module was not left behind in sys.modules
    path.write_text("def fn(args):\n    return 'fixed'\n")
    assert load_function(f"{path}:fn")(None) == "fixed"


# ---------------------------------------------------------------------------------------------------------------
# attribute errors


def test_missing_attribute_lists_public_callables_and_suggests(pkg):
    _, message = error("plugpkg.good:compute_mi")
    assert "'compute_mi'" in message
    assert "did you mean 'compute_mis'?" in message
    assert "Public callables there: Corrector, compute_mis, weights" in message  # sorted, no _private, no VALUE
    assert "_private" not in message and "VALUE" not in message


def test_missing_attribute_without_close_match(pkg):
    _, message = error("plugpkg.good.zzzzzz")
    assert "'zzzzzz'" in message
    assert "did you mean" not in message
    assert "Corrector, compute_mis, weights" in message


def test_missing_attribute_in_file_and_nested(tmp_path, pkg):
    path = write(tmp_path / "f.py", "def alpha(args):\n    pass\n")
    _, message = error(f"{path}:alpah")
    assert str(path) in message and "did you mean 'alpha'?" in message
    _, message = error("plugpkg.good:Corrector.runn")
    assert "plugpkg.good:Corrector has no attribute 'runn'" in message
    assert "did you mean 'run'?" in message


def test_short_name_typo_is_malformed_not_a_crash():
    _, message = error("miss")
    assert "malformed" in message and "mis/tis/icepop" in message


def test_not_callable_says_its_type(pkg):
    _, message = error("plugpkg.good:VALUE")
    assert "VALUE" in message
    assert "not callable" in message
    assert "int" in message


# ---------------------------------------------------------------------------------------------------------------
# contracts


@pytest.mark.parametrize("name", ["mis", "tis", "icepop"])
def test_builtins_satisfy_tis_contract(name):
    assert load_function(name, contract=TIS_CONTRACT) is not None
    assert load_function(SHORT_NAMES[name], contract=TIS_CONTRACT) is load_function(name)


def test_non_cp_mis_fails_tis_contract_naming_pg_loss():
    spec = "custom_tis.mis:compute_mis_weights"
    assert load_function(spec) is custom_tis.mis.compute_mis_weights  # fine without a contract
    _, message = error(spec, contract=TIS_CONTRACT)
    assert "does not accept keyword(s) pg_loss, total_lengths, response_lengths" in message
    assert "(args, *, train_log_probs, rollout_log_probs, loss_masks)" in message  # the signature


def test_kwargs_function_passes_any_contract(pkg):
    fn = load_function("plugpkg.good:compute_mis", contract=TIS_CONTRACT + ("anything", "else"))
    assert fn(1, a=2) == ("good.compute_mis", {"a": 2})
    # the same extra keywords are refused by a function without **kwargs
    assert load_function("plugpkg.good:weights", contract=TIS_CONTRACT) is not None
    _, message = error("plugpkg.good:weights", contract=TIS_CONTRACT + ("anything", "else"))
    assert "does not accept keyword(s) anything, else" in message


def test_contract_reports_required_parameter_not_supplied(pkg):
    _, message = error("plugpkg.good:weights", contract=("pg_loss", "train_log_probs"))
    assert "requires parameter(s) rollout_log_probs, loss_masks, total_lengths, response_lengths" in message
    assert "does not accept" not in message


def test_contract_reports_both_kinds_of_mismatch():
    def fn(args, pg_loss, extra, *, loss_masks, flag=False):
        pass

    with pytest.raises(PluginError) as info:
        check_contract(fn, ("pg_loss", "loss_masks", "total_lengths"), spec="my.spec")
    message = str(info.value)
    assert message.startswith("my.spec:")
    assert "does not accept keyword(s) total_lengths" in message
    assert "requires parameter(s) extra " in message
    assert "flag" not in message.split("):", 1)[1]  # has a default: not reported as missing
    assert "(args, pg_loss, extra, *, loss_masks, flag=False)" in message


def test_contract_positional_only_and_args_slot():
    def pos_only(args, pg_loss, /):
        pass

    with pytest.raises(PluginError, match=r"does not accept keyword\(s\) pg_loss"):
        check_contract(pos_only, ("pg_loss",))

    def no_positional(*, pg_loss):
        pass

    with pytest.raises(PluginError, match="no positional parameter for args"):
        check_contract(no_positional, ("pg_loss",))


def test_uninspectable_builtin_passes_contract():
    check_contract(max, TIS_CONTRACT)  # max has no inspectable signature: not checked
    assert load_function("builtins.max", contract=TIS_CONTRACT) is max
    with pytest.raises(PluginError, match=r"does not accept keyword\(s\) pg_loss"):
        check_contract(len, ("pg_loss",))  # len's signature is known: (obj, /)


def test_file_form_of_a_package_module_is_that_module(tmp_path, monkeypatch):
    """``custom_tis/mis.py:fn`` (relative imports inside) loads as ``custom_tis.mis``: the same function slime's
    dotted path names; a package file on a path that is not importable under its name still loads as a file."""
    import custom_tis

    path = os.path.join(os.path.dirname(custom_tis.__file__), "mis.py")
    assert load_function(f"{path}:compute_mis_weights_with_cp") is custom_tis.mis.compute_mis_weights_with_cp
    monkeypatch.chdir(os.path.dirname(os.path.dirname(path)))
    assert load_function("custom_tis/tis.py:compute_tis_weights_with_cp") is custom_tis.tis.compute_tis_weights_with_cp
    copy = write(tmp_path / "elsewhere" / "custom_tis" / "solo.py", "def fn(args):\n    return 7\n")
    write(tmp_path / "elsewhere" / "custom_tis" / "__init__.py", "")
    assert load_function(f"{copy}:fn")(None) == 7
