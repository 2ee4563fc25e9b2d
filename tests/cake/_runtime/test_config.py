"""Every configuration rule of DESIGN.md, on synthetic ops (so no rule passes vacuously for lack of real ops)."""
import argparse
import dataclasses
import logging

import pytest

import miles_ext_kernels as mek
from miles_ext_kernels.cake._runtime import config, registry
from tests.cake._runtime._ops import DET_CLI_ONLY, FAST_ONLY, SYNTHETIC

pytestmark = pytest.mark.registered_ops(SYNTHETIC, FAST_ONLY, DET_CLI_ONLY)


def parse(*argv, parser=None):
    parser = parser or argparse.ArgumentParser()
    mek.add_arguments(parser)
    return parser.parse_args(list(argv))


def resolved(*argv):
    args = parse(*argv)
    mek.validate_args(args)
    return args


def test_unconfigured_process_runs_det():
    assert config.variant("synthetic") == "det"
    assert config.variant("fastonly") == "fast"  # an op without det runs what it ships


def test_cli_default_is_fast_and_written_back():
    args = resolved("--synthetic-backend", "cake")
    assert args.cake_synthetic_variant == "fast"
    mek.configure(args)
    assert config.variant("synthetic") == "fast"


@pytest.mark.parametrize("v", ["det", "fast"])
def test_explicit_variant_kept(v):
    args = resolved("--synthetic-backend", "cake", "--cake-synthetic-variant", v)
    assert args.cake_synthetic_variant == v
    mek.configure(args)
    assert config.variant("synthetic") == v


def test_deterministic_mode_flat_flag_resolves_det():
    args = resolved("--synthetic-backend", "cake", "--deterministic-mode")
    assert args.cake_synthetic_variant == "det"
    mek.configure(args)
    assert config.variant("synthetic") == "det"


@dataclasses.dataclass
class TransformerConfig:
    deterministic_mode: bool = False


@dataclasses.dataclass
class TypedArgs:
    synthetic_backend: str = "cake"
    config: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
    cake_synthetic_variant: str = None


def test_deterministic_mode_typed_config_object():
    args = TypedArgs(config=TransformerConfig(deterministic_mode=True))
    mek.validate_args(args)
    assert args.cake_synthetic_variant == "det"
    args = TypedArgs(config=TransformerConfig(deterministic_mode=False))
    mek.validate_args(args)
    assert args.cake_synthetic_variant == "fast"
    args = TypedArgs(config=TransformerConfig(deterministic_mode=True), cake_synthetic_variant="fast")
    with pytest.raises(ValueError, match="deterministic"):
        mek.validate_args(args)


def test_explicit_fast_with_deterministic_mode_rejected():
    with pytest.raises(ValueError, match="deterministic"):
        resolved("--synthetic-backend", "cake", "--cake-synthetic-variant", "fast", "--deterministic-mode")
    with pytest.raises(ValueError, match="deterministic"):
        mek.configure(deterministic_mode=True, synthetic_variant="fast")


def test_op_without_det_rejected_under_deterministic_mode():
    with pytest.raises(ValueError, match="no det variant"):
        resolved("--fastonly-backend", "cake", "--deterministic-mode")
    # direct callers: configuring is allowed (the op may never run), the call raises
    mek.configure(deterministic_mode=True)
    with pytest.raises(RuntimeError, match="no det variant"):
        config.variant("fastonly")
    assert config.variant("synthetic") == "det"


def test_option_without_selector_rejected():
    with pytest.raises(ValueError, match="--cake-synthetic-check-inputs.*not selected"):
        resolved("--cake-synthetic-check-inputs")
    with pytest.raises(ValueError, match="not selected"):
        resolved("--cake-synthetic-precision", "fp32")
    with pytest.raises(ValueError, match="not selected"):
        resolved("--cake-synthetic-variant", "det")
    args = resolved("--synthetic-backend", "cake", "--cake-synthetic-check-inputs", "--cake-synthetic-precision",
                    "fp32")
    mek.configure(args)
    assert config.option("synthetic", "check_inputs") is True
    assert config.option("synthetic", "precision") == "fp32"


def test_options_defaults_written_back():
    args = resolved("--synthetic-backend", "cake")
    assert args.cake_synthetic_check_inputs is False and args.cake_synthetic_precision == "bf16"
    assert config.option("synthetic", "precision") == "bf16"


def test_hidden_variant_flag_when_one_cli_variant():
    parser = argparse.ArgumentParser()
    mek.add_arguments(parser)
    text = parser.format_help()
    assert "--cake-synthetic-variant" in text
    assert "--cake-detcli-variant" not in text  # hidden ...
    args = parser.parse_args(["--detcli-backend", "cake", "--cake-detcli-variant", "det"])  # ... but accepted
    mek.validate_args(args)
    assert args.cake_detcli_variant == "det"
    with pytest.raises(SystemExit):
        parser.parse_args(["--detcli-backend", "cake", "--cake-detcli-variant", "fast"])
    args = resolved("--detcli-backend", "cake")
    assert args.cake_detcli_variant == "det"  # the one CLI variant is the default


def test_add_arguments_never_adds_existing_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deterministic-mode", action="store_true", help="miles' own flag")
    parser.add_argument("--synthetic-backend", choices=["te", "cake"], default="te")
    mek.add_arguments(parser)
    mek.add_arguments(parser)  # twice: still no conflict
    det = [a for a in parser._actions if a.dest == "deterministic_mode"]
    assert len(det) == 1 and det[0].help == "miles' own flag"
    assert parser.parse_args([]).synthetic_backend == "te"


def test_configure_resets_and_replaces():
    mek.configure(synthetic_variant="fast", synthetic_precision="fp32", workspace_pool_bytes=1024)
    assert config.variant("synthetic") == "fast" and config.option("synthetic", "precision") == "fp32"
    assert config.pool_bytes() == 1024
    mek.configure(synthetic_check_inputs=True)  # replaces the whole configuration
    assert config.variant("synthetic") == "det" and config.option("synthetic", "precision") == "bf16"
    assert config.pool_bytes() == 0
    mek.configure()
    assert config.option("synthetic", "check_inputs") is False


def test_configure_rejects_bad_keywords():
    with pytest.raises(TypeError, match="unexpected keyword 'nosuchop_variant'"):
        mek.configure(nosuchop_variant="det")
    with pytest.raises(TypeError, match="unexpected keyword 'synthetic_nosuch'"):
        mek.configure(synthetic_nosuch=True)
    with pytest.raises(ValueError, match="synthetic_variant"):
        mek.configure(synthetic_variant="fastest")
    with pytest.raises(ValueError, match="synthetic_variant"):
        mek.configure(fastonly_variant="fast", synthetic_variant="turbo")
    with pytest.raises(ValueError, match="synthetic_precision"):
        mek.configure(synthetic_precision="fp64")
    with pytest.raises(TypeError, match="synthetic_check_inputs"):
        mek.configure(synthetic_check_inputs="yes")
    with pytest.raises(ValueError, match="workspace_pool_bytes"):
        mek.configure(workspace_pool_bytes=-1)
    with pytest.raises(TypeError, match="either"):
        mek.configure(parse(), synthetic_variant="det")


def test_configure_args_in_every_process_sees_the_same():
    args = resolved("--synthetic-backend", "cake", "--cake-workspace-pool-bytes", "4096")
    mek.configure()
    mek.configure(args)  # a second process calling configure(args) after the launcher validated
    assert config.variant("synthetic") == "fast" and config.pool_bytes() == 4096


def test_op_validate_runs_for_selected_op_only():
    args = parse("--synthetic-backend", "cake")
    args.synthetic_heads = 0
    with pytest.raises(ValueError, match="heads"):
        mek.validate_args(args)
    args = parse()
    args.synthetic_heads = 0
    mek.validate_args(args)  # not selected: its validate does not run


def test_variant_read_at_call_time():
    impl = SYNTHETIC.impl()
    assert impl.which_variant() == "det"
    mek.configure(synthetic_variant="fast")
    assert impl.which_variant() == "fast"
    mek.configure(synthetic_variant="det")
    assert impl.which_variant() == "det"


def test_torch_deterministic_algorithms_downgrades_fast(caplog):
    import torch

    mek.configure(synthetic_variant="fast")
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with caplog.at_level(logging.WARNING, logger="miles_ext_kernels"):
            assert config.variant("synthetic") == "det"
            assert config.variant("synthetic") == "det"
        assert sum("running det" in r.message for r in caplog.records) == 1  # logged once
        mek.configure(fastonly_variant="fast")
        with pytest.raises(RuntimeError, match="no deterministic implementation"):
            config.variant("fastonly")
    finally:
        torch.use_deterministic_algorithms(prev)
    assert config.variant("fastonly") == "fast"


def test_unknown_op():
    with pytest.raises(KeyError, match="unknown cake op 'nosuch'"):
        config.variant("nosuch")
    with pytest.raises(KeyError):
        registry.op_spec("nosuch")


def test_spec_rejects_bad_declarations():
    from miles_ext_kernels.cake._runtime.spec import Flag, OpSpec

    with pytest.raises(ValueError):
        OpSpec("x", variants=("slow",))
    with pytest.raises(ValueError):
        OpSpec("x", variants=("fast",), cli_variants=("det",))
    with pytest.raises(ValueError):
        OpSpec("x", options=(Flag("a", "h"), Flag("a", "h")))
    with pytest.raises(ValueError):
        Flag("p", "h", choices=("a", "b"), default="c")
    with pytest.raises(ValueError):
        registry.registered(SYNTHETIC).__enter__()


# ---------------------------------------------------------------------------------------------------------------
# nothing a user sets is dropped silently; wrong inputs raise the right exception type
def test_flags_the_parser_has_under_another_dest_are_read_there():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deterministic-mode", dest="det", action="store_true")
    parser.add_argument("--cake-workspace-pool-bytes", dest="pool", type=int, default=0)
    parser.add_argument("--synthetic-backend", dest="synth_be", default=None)
    mek.add_arguments(parser)
    mek.add_arguments(parser)  # twice: the recorded dests survive
    args = parser.parse_args(["--deterministic-mode", "--cake-workspace-pool-bytes", "4096",
                              "--synthetic-backend", "cake"])
    mek.validate_args(args)
    assert args.cake_synthetic_variant == "det"  # deterministic mode was seen: not fast
    mek.configure(args)
    assert config.pool_bytes() == 4096 and config.deterministic_mode() and config.variant("synthetic") == "det"
    mek.configure()
    mek.configure(args)  # another process: configure(args) alone reads the same dests
    assert config.pool_bytes() == 4096 and config.variant("synthetic") == "det"
    args = parser.parse_args(["--synthetic-backend", "cake", "--cake-synthetic-variant", "fast",
                              "--deterministic-mode"])
    with pytest.raises(ValueError, match="deterministic"):
        mek.validate_args(args)


def test_configure_refuses_a_dict_and_non_args():
    mek.configure(synthetic_variant="fast")
    with pytest.raises(TypeError, match=r"configure\(\*\*d\)"):
        mek.configure({"synthetic_variant": "fast"})
    assert config.variant("synthetic") == "fast"  # refused before anything was replaced
    for bad in (None, {}, {"synthetic_backend": "cake"}, "args", 3):
        with pytest.raises(TypeError, match="validate_args"):
            mek.validate_args(bad)
    for bad in (None, "parser", argparse.Namespace()):
        with pytest.raises(TypeError, match="ArgumentParser"):
            mek.add_arguments(bad)


def test_configure_args_without_validate_args_drops_nothing():
    # a variant or an option of an op that is not selected: refused as validate_args refuses it
    with pytest.raises(ValueError, match="--cake-synthetic-variant given but cake op 'synthetic' is not selected"):
        mek.configure(argparse.Namespace(cake_synthetic_variant="fast"))
    with pytest.raises(ValueError, match="--cake-synthetic-precision given"):
        mek.configure(parse("--cake-synthetic-precision", "fp32"))
    # configure()'s keyword names on args are not read from there: refused, not dropped
    with pytest.raises(ValueError, match="synthetic_variant.*cake_synthetic_variant"):
        mek.configure(argparse.Namespace(synthetic_backend="cake", synthetic_variant="det"))
    with pytest.raises(ValueError, match="workspace_pool_bytes"):
        mek.validate_args(argparse.Namespace(workspace_pool_bytes=4096))
    # what configure(args) does take it applies, validated or not
    args = parse("--synthetic-backend", "cake", "--cake-synthetic-variant", "det", "--cake-synthetic-precision",
                 "fp32", "--cake-workspace-pool-bytes", "64")
    mek.configure(args)
    assert config.variant("synthetic") == "det" and config.option("synthetic", "precision") == "fp32"
    assert config.pool_bytes() == 64


@pytest.mark.parametrize("value", ["Cake", "CAKE", " cake", "cake "])
def test_near_miss_selector_value_is_an_error_naming_the_flag(value):
    with pytest.raises(ValueError, match="--synthetic-backend .*case-sensitive; use 'cake'"):
        resolved("--synthetic-backend", value)
    with pytest.raises(ValueError, match="--synthetic-backend"):
        mek.configure(argparse.Namespace(synthetic_backend=value))
    resolved("--synthetic-backend", "te")  # another backend is no near miss


def test_configure_suggests_the_closest_keyword():
    with pytest.raises(TypeError, match="unexpected keyword 'synthetic_varient'.*did you mean 'synthetic_variant'"):
        mek.configure(synthetic_varient="fast")
    with pytest.raises(TypeError, match="did you mean 'synthetic_precision'"):
        mek.configure(synthetic_precison="fp32")
    with pytest.raises(TypeError, match="did you mean 'workspace_pool_bytes'"):
        mek.configure(workspace_pool_byte=1)
    with pytest.raises(TypeError, match="did you mean 'synthetic_variant'"):
        mek.configure(synthetc_variant="det")
    with pytest.raises(ValueError, match="did you mean 'fast'"):
        mek.configure(synthetic_variant="Fast")


def test_unknown_op_is_a_value_error_with_a_plain_message():
    from miles_ext_kernels import cake

    for call in (lambda: cake.release("nosuch"), lambda: cake.prebuild("nosuch"), lambda: cake.op_spec("nosuch")):
        with pytest.raises(ValueError) as info:
            call()
        assert isinstance(info.value, KeyError)  # still caught by `except KeyError`, as before
        assert str(info.value).startswith("unknown cake op 'nosuch' (known: ")  # no KeyError quoting
        assert "synthetic" in str(info.value)
    with pytest.raises(TypeError, match="op name must be a str"):
        registry.op_spec(None)
