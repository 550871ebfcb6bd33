"""ServerArgs: one definition of every flag, shared by the server and the CLI, and what it builds."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dspark_jax.server_args import ServerArgs


def _parse(argv, server=True) -> ServerArgs:
    ap = argparse.ArgumentParser()
    ServerArgs.add_cli_args(ap, server=server)
    return ServerArgs.from_namespace(ap.parse_args(argv))


def test_every_field_is_one_flag_and_the_cli_takes_the_engine_ones():
    ap = argparse.ArgumentParser()
    ServerArgs.add_cli_args(ap)
    flags = {a.dest: a.option_strings for a in ap._actions if a.dest != "help"}
    assert set(flags) == {f.name for f in dataclasses.fields(ServerArgs)}
    assert flags["precompile"] == ["--no-precompile"] and flags["max_running_requests"] == ["--max-running-requests"]
    cli = argparse.ArgumentParser()
    ServerArgs.add_cli_args(cli, server=False)
    cli_dests = {a.dest for a in cli._actions}
    assert "port" not in cli_dests and "max_body_bytes" not in cli_dests and "verify_mode" in cli_dests
    args = _parse(["--max-running-requests", "4", "--no-precompile", "--speculative-algorithm", "mtp", "--port", "1"])
    assert (args.max_running_requests, args.precompile, args.speculative_algorithm, args.port) == (4, False, "MTP", 1)
    assert _parse([]) == ServerArgs()


def test_the_default_is_compact_with_a_derived_table_and_none_verifies_everything():
    spec = ServerArgs().resolve().speculative_config()
    assert (spec.mode, spec.cost_table) == ("compact", "derive")
    assert ServerArgs(sps_table_path="none").resolve().speculative_config().cost_table is None
    assert ServerArgs(verify_mode="static").resolve().speculative_config().cost_table is None  # static reads none
    assert ServerArgs(speculative_algorithm="NONE").resolve().speculative_config() is None
    ec = ServerArgs(max_total_tokens=100, page_size=16).resolve().engine_config()
    assert ec.num_pages == 7 + 1  # the pool in pages, plus the sentinel page


def test_an_expanded_model_brings_its_own_drafters():
    r = ServerArgs(model_path="expand:qwen3-8b").resolve()
    assert (r.speculative_algorithm, r.draft_model_path) == ("DSPARK", "expand:qwen3-8b")
    assert ServerArgs(model_path="expand:qwen3-8b", speculative_algorithm="MTP").resolve().draft_model_path == \
        "expand:qwen3-8b"
    assert ServerArgs(model_path="expand:qwen3-8b", speculative_algorithm="NONE").resolve().draft_model_path is None
    with pytest.raises(ValueError, match="drop --draft-model-path"):
        ServerArgs(model_path="expand:qwen3-8b", draft_model_path="x").resolve()


def test_logit_processors_flag_feeds_the_engine_config():
    assert _parse([]).resolve().engine_config().logit_processors == "lazy"
    assert _parse(["--logit-processors", "off"]).resolve().engine_config().logit_processors == "off"
    with pytest.raises(SystemExit):
        _parse(["--logit-processors", "sometimes"])
