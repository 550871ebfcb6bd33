"""ServerArgs: every user-facing option, defined once, feeding the server, the CLI and the engine.

    args = ServerArgs.from_cli(argv, prog="python -m serving.launch")
    engine = args.build_engine()

Each field is one flag (``--field-name``) with one help text; the CLI (dspark_jax.generate)
takes every field not marked ``server`` in its metadata.  ``resolve`` fills the defaults that
depend on each other (model, drafter, algorithm) and checks combinations; ``engine_config`` and
``speculative_config`` build what the engine takes.  Argparse is imported lazily and jax not at
all, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import field
from pathlib import Path

ALGORITHMS = ("NONE", "DSPARK", "MTP")
EXPAND_PREFIX = "expand:"


def _opt(default=None, help: str = "", **meta):
    return field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass
class ServerArgs:
    # -- model and drafter ---------------------------------------------------------------------
    model_path: str | None = _opt(help="Hugging Face Qwen3 folder (default: the embedded default model), or "
                                       "expand:SHAPE (qwen3-8b, qwen3-4b, qwen3-1.7b) for the embedded pair expanded to "
                                       "that shape in memory, every token choice kept (dspark_jax.expand)")
    draft_model_path: str | None = _opt(
        help="drafter folder: a DSpark drafter, or an MTP drafter for --speculative-algorithm MTP (default with "
             "the embedded model: its embedded drafter of that kind)")
    speculative_algorithm: str | None = _opt(
        help="DSPARK (block drafting), MTP (the EAGLE-style chain drafter, the baseline arm) or NONE (plain "
             "decoding); default: the kind of --draft-model-path, DSPARK for the embedded model", choices=ALGORITHMS,
        type=str.upper)
    verify_mode: str = _opt("compact", help="DSpark verify mode: compact (each request's window scheduled against the "
                                             "cost table, plain decode steps where no window pays), static (every "
                                             "block verified) or cap-accept (full verify, compact's commits, the "
                                             "ceiling reported)", choices=("static", "compact", "cap-accept"))
    block_size: int | None = _opt(help="DSpark block size; must equal the drafter's trained block size")
    sps_table_path: str | None = _opt(help="additive step-cost table JSON for compact budgets, or 'none' to verify "
                                           "everything; default: profiled on this device at start-up and cached")
    sps_min_gain: float | None = _opt(help="trim only when the predicted throughput beats verify-all by this "
                                           "fraction (default 0.04)")
    rounds_per_call: int | None = _opt(help="DSpark rounds per dispatched executable (default 1); tokens then "
                                            "stream that many rounds at a time")
    sts_path: str | None = _opt(help="STS confidence calibration JSON (default: the drafter folder's sts.json, "
                                     "else identity temperatures)")
    record_sts_dir: str | None = _opt(help="write STS calibration data (raw confidence logits, accepted drafts) "
                                           "here; needs --verify-mode static or cap-accept and no --sts-path")
    mtp_steps: int | None = _opt(help="MTP chain length k (SGLang 3-1-4 is k = 3); default: the drafter folder's, "
                                      "else 3")
    # -- engine ----------------------------------------------------------------------------------
    max_running_requests: int = _opt(16, help="decode slots (continuous batching)")
    max_model_len: int | None = _opt(help="context length (default: min(model max positions, 4096))")
    max_total_tokens: int | None = _opt(help="KV pool size in tokens (default: every slot can hold a full "
                                             "context, within device memory)")
    max_prefill_tokens: int = _opt(512, help="prefill chunk token budget per step")
    page_size: int = _opt(16, help="KV page size in tokens")
    kernels: str = _opt("auto", help="Pallas kernels: auto (on the GPU), pallas or reference (plain jnp)",
                        choices=("auto", "pallas", "reference"))
    dtype: str | None = _opt(help="parameter dtype (default: float32 on CPU, else the checkpoint's)",
                             choices=("float32", "bfloat16"))
    precompile: bool = _opt(True, help="compile every executable on first use instead of at start-up",
                            flag="--no-precompile")
    logit_processors: str = _opt("lazy", help="logprobs, penalties, logit_bias, min_tokens: lazy (compiled on first "
                                              "use, in the background), precompile (at start-up) or off (refused)",
                                 choices=("lazy", "precompile", "off"))
    # -- parallelism (SGLang's names) --------------------------------------------------------------
    tp_size: int = _opt(1, help="tensor parallelism: devices one engine's model is split over (Megatron style)")
    dp_size: int = _opt(1, help="data parallelism: engine replicas of tp-size devices each; the server "
                                "sends each request to the least-loaded one", server=True)
    nnodes: int = _opt(1, help="hosts (processes) the engine spans; with more than one, every host runs this "
                               "command with its --node-rank")
    node_rank: int = _opt(0, help="this host's rank among --nnodes (0 serves HTTP; the others follow its steps)")
    dist_init_addr: str | None = _opt(help="host:port of rank 0's coordinator for --nnodes > 1 "
                                           "(jax.distributed.initialize)")
    # -- server ----------------------------------------------------------------------------------
    served_model_name: str | None = _opt(help="name clients pass as 'model' (default: the folder name)", server=True)
    host: str = _opt("127.0.0.1", help="address to listen on", server=True)
    port: int = _opt(30000, help="port to listen on", server=True)
    shutdown_timeout: float = _opt(30.0, help="seconds in-flight requests get after SIGTERM", server=True)
    log_level: str = _opt("info", help="logging level", server=True)
    max_body_bytes: int = _opt(4 << 20, help="largest request body accepted, in bytes (larger: 413)", server=True)
    default_chat_max_tokens: int = _opt(1024, help="max_tokens of a chat request that sets none (capped by the "
                                                   "context left after the prompt)", server=True)

    # -- command line ----------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, server: bool = True) -> None:
        """One flag per field (server-only fields only when ``server``)."""
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta.get("server") and not server:
                continue
            flag = meta.get("flag", "--" + f.name.replace("_", "-"))
            if f.type == "bool" or isinstance(f.default, bool):
                parser.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true",
                                    help=meta["help"])
                continue
            kind = meta.get("type") or {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            parser.add_argument(flag, dest=f.name, default=f.default, type=kind, choices=meta.get("choices"),
                                help=meta["help"] + (f" (default {f.default})" if f.default is not None else ""))

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})

    # -- resolution ----------------------------------------------------------------------------
    def resolve(self) -> ServerArgs:
        """Fill the model, drafter and algorithm defaults and check every combination; raises
        ValueError naming the flags."""
        from dspark_jax.default_model import default_drafter_path, default_model_path, default_mtp_path
        from dspark_jax.spec.loading import is_mtp_folder

        embedded = self.model_path is None
        model = self.model_path or str(default_model_path())
        expanded = model.startswith(EXPAND_PREFIX)
        if expanded and self.draft_model_path:
            raise ValueError(f"{model} brings its own expanded drafters: drop --draft-model-path")
        algo = self.speculative_algorithm
        if algo is not None and algo not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {ALGORITHMS}, got {algo!r}")
        if algo is None:
            if self.draft_model_path:
                algo = "MTP" if is_mtp_folder(self.draft_model_path) else "DSPARK"
            else:
                algo = "DSPARK" if expanded or (embedded and default_drafter_path() is not None) else "NONE"
        draft = self.draft_model_path
        if expanded and algo != "NONE":
            draft = model  # the expansion's own drafter of that kind
        elif draft is None and embedded and algo != "NONE":
            embedded_draft = default_mtp_path() if algo == "MTP" else default_drafter_path()
            draft = str(embedded_draft) if embedded_draft else None
        if algo != "NONE" and draft is None:
            raise ValueError(f"--speculative-algorithm {algo} needs --draft-model-path (an embedded drafter only "
                             "serves the embedded default model)")
        if algo == "NONE" and self.draft_model_path:
            raise ValueError("--draft-model-path given with --speculative-algorithm NONE")
        dspark_only = [flag for flag, given in (
            ("--verify-mode", self.verify_mode != "compact"), ("--block-size", self.block_size is not None),
            ("--sps-table-path", self.sps_table_path), ("--sps-min-gain", self.sps_min_gain is not None),
            ("--rounds-per-call", self.rounds_per_call is not None), ("--sts-path", self.sts_path),
            ("--record-sts-dir", self.record_sts_dir)) if given]
        if algo != "DSPARK" and dspark_only:
            raise ValueError(f"{', '.join(dspark_only)}: DSpark options, not used by --speculative-algorithm {algo}")
        if algo != "MTP" and self.mtp_steps is not None:
            raise ValueError("--mtp-steps needs --speculative-algorithm MTP")
        if self.block_size is not None and not expanded:
            _check_block_size(draft, self.block_size)
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr (host:port of rank 0)")
        if self.nnodes > 1 and self.dp_size > 1 and self.dp_size % self.nnodes:
            raise ValueError(f"--dp-size {self.dp_size} over --nnodes {self.nnodes}: every host holds the same number "
                             "of replicas, so --dp-size must be a multiple of --nnodes")
        if not 0 <= self.node_rank < max(self.nnodes, 1):
            raise ValueError(f"--node-rank must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        for flag, value, low in (("--tp-size", self.tp_size, 1), ("--dp-size", self.dp_size, 1),
                                 ("--nnodes", self.nnodes, 1),
                                 ("--max-running-requests", self.max_running_requests, 1),
                                 ("--max-prefill-tokens", self.max_prefill_tokens, 1), ("--page-size", self.page_size, 1),
                                 ("--rounds-per-call", self.rounds_per_call, 1), ("--mtp-steps", self.mtp_steps, 1),
                                 ("--max-total-tokens", self.max_total_tokens, 1), ("--max-model-len", self.max_model_len, 2),
                                 ("--sps-min-gain", self.sps_min_gain, 0), ("--max-body-bytes", self.max_body_bytes, 1),
                                 ("--default-chat-max-tokens", self.default_chat_max_tokens, 1)):
            if value is not None and not value >= low:
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        return dataclasses.replace(self, model_path=model, draft_model_path=draft, speculative_algorithm=algo)

    def init_distributed(self) -> bool:
        """Join the --nnodes processes (jax.distributed.initialize; before anything else uses
        JAX); False for one node."""
        from dspark_jax.parallel.multihost import check_same_engine_args, initialize

        if not initialize(self.nnodes, self.node_rank, self.dist_init_addr):
            return False
        check_same_engine_args(self.engine_args())
        return True

    def engine_args(self) -> dict:
        """The fields every node's engine is built from: all but the HTTP server's and the rank."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not f.metadata.get("server") and f.name != "node_rank"}

    # -- what the engine takes -------------------------------------------------------------------
    def engine_config(self):
        from dspark_jax.engine.config import EngineConfig

        num_pages = -(-self.max_total_tokens // self.page_size) + 1 if self.max_total_tokens else None  # + sentinel
        return EngineConfig(max_running_requests=self.max_running_requests, max_model_len=self.max_model_len,
                            page_size=self.page_size, num_pages=num_pages, max_prefill_tokens=self.max_prefill_tokens,
                            kernels=self.kernels, dtype=self.dtype, precompile=self.precompile,
                            tp_size=self.tp_size, dp_size=self.dp_size, logit_processors=self.logit_processors)

    def speculative_config(self):
        """The SpeculativeConfig of resolved args (None for plain decoding)."""
        from dspark_jax.calibration.sts import StsCalibration
        from dspark_jax.spec.config import SpeculativeConfig
        from dspark_jax.spec.dspark.cost_model import load_cost_table

        if self.speculative_algorithm == "NONE":
            return None
        if self.speculative_algorithm == "MTP":
            return SpeculativeConfig(algorithm="mtp", num_steps=self.mtp_steps)
        table = self.sps_table_path
        if table is None:  # a static engine never reads a table
            table = "derive" if self.verify_mode != "static" else None
        else:
            table = None if table.lower() == "none" else load_cost_table(table)
        spec = SpeculativeConfig(mode=self.verify_mode, cost_table=table,
                                 sts=StsCalibration.load(self.sts_path) if self.sts_path else None,
                                 rounds_per_call=self.rounds_per_call or 1, record_sts_dir=self.record_sts_dir)
        if self.sps_min_gain is not None:
            spec.min_predicted_gain = float(self.sps_min_gain)
        spec.validate()
        return spec

    def build_engine(self):
        """The engine these (resolved) args describe."""
        from dspark_jax.engine import Engine

        spec = self.speculative_config()
        if self.model_path.startswith(EXPAND_PREFIX):
            return self._expanded_engine(spec)
        return Engine.from_pretrained(self.model_path, self.engine_config(), spec,
                                      draft_path=self.draft_model_path if spec is not None else None)

    def build_host_replicas(self) -> dict:
        """Several hosts with dp_size > 1: this host's replicas, {replica index: engine}
        (dspark_jax.parallel.host_replicas).  Each derives its cost table now: every host takes
        rank 0's table, one broadcast per replica, so the hosts must derive in the same order
        (a table derived lazily, at a replica's first request, would leave them unpaired)."""
        import jax

        from dspark_jax.parallel.mesh import host_replica_groups

        groups = host_replica_groups(self.tp_size, self.dp_size)
        mine = [r for r, g in enumerate(groups) if g[0].process_index == jax.process_index()]
        engines = self.build_engines([groups[r] for r in mine])
        if not self.precompile:
            for e in engines:
                e.calibrate(compile=False)
        return dict(zip(mine, engines))

    def build_engines(self, groups: list | None = None) -> list:
        """The dp_size engine replicas these (resolved) args describe, each on its own tp_size
        devices (replica r on devices [r * tp, (r + 1) * tp)), or one on each device group given;
        the model is read once."""
        if self.dp_size == 1 and groups is None:
            return [self.build_engine()]
        from dspark_jax.engine.engine import Engine, compile_engines
        from dspark_jax.parallel.mesh import replica_device_groups

        groups = groups if groups is not None else replica_device_groups(self.tp_size, self.dp_size)
        ec = dataclasses.replace(self.engine_config(), precompile=False)
        if self.tp_size > 1 and not self.model_path.startswith(EXPAND_PREFIX):
            # each replica reads the checkpoint straight into its own shards
            spec = self.speculative_config()
            engines = [Engine.from_pretrained(self.model_path, ec, dataclasses.replace(spec) if spec else None,
                                              draft_path=self.draft_model_path if spec else None, devices=g)
                       for g in groups]
        else:  # read once, placed on each replica's devices
            model, tokenizer, drafter, spec = self._parts()
            engines = [Engine(model, tokenizer, ec, drafter=drafter, spec=dataclasses.replace(spec) if spec else None,
                              devices=g) for g in groups]
        if self.precompile:  # every replica's executables in one pool, then each derives its table
            seconds = compile_engines(engines)
            for e in engines:
                e.compile_seconds = seconds
                e.calibrate(compile=True)
        return engines

    def _parts(self):
        """(target, tokenizer, drafter or None, SpeculativeConfig or None), read once."""
        import jax

        from dspark_jax.checkpoint import load_model
        from dspark_jax.tokenizer import Tokenizer

        spec = self.speculative_config()
        if self.model_path.startswith(EXPAND_PREFIX):
            return self._expanded_parts(spec)
        dtype = self.dtype or ("float32" if jax.default_backend() == "cpu" else None)
        tcfg, model = load_model(self.model_path, dtype=dtype)
        drafter = None
        if spec is not None:
            from dspark_jax.spec.loading import load_drafter_for

            drafter, spec = load_drafter_for(tcfg, model, self.draft_model_path, spec)
        return model, Tokenizer.from_folder(self.model_path), drafter, spec

    def _expanded_engine(self, spec):
        from dspark_jax.engine import Engine

        target, tokenizer, drafter, spec = self._expanded_parts(spec)
        return Engine(target, tokenizer, self.engine_config(), drafter=drafter, spec=spec)

    def _expanded_parts(self, spec):
        """The embedded pair expanded in memory to the shape after ``expand:``."""
        import dataclasses as dc

        import jax

        from dspark_jax.calibration.sts import StsCalibration
        from dspark_jax.expand import expand_pair

        dtype = self.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
        pair = expand_pair(shape=self.model_path[len(EXPAND_PREFIX):], dtype=dtype, progress=True,
                           max_position_embeddings=max(self.max_model_len or 4096, 4096))
        drafter = {"DSPARK": pair.drafter, "MTP": pair.mtp}.get(self.speculative_algorithm)
        if spec is not None and spec.algorithm == "dspark" and spec.sts is None and not spec.record_sts_dir \
                and pair.sts_path is not None:
            spec = dc.replace(spec, sts=StsCalibration.load(pair.sts_path))
        if spec is not None and spec.algorithm == "mtp" and spec.num_steps is None:
            spec = dc.replace(spec, num_steps=3)
        return pair.target, pair.tokenizer, drafter, spec

    def to_json(self) -> str:
        return json.dumps({k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()})


def _check_block_size(draft_folder, block_size: int) -> None:
    """--block-size must equal the drafter's trained block size (read from its config alone)."""
    from dspark_jax.errors import CheckpointError
    from dspark_jax.spec.dspark.checkpoint import CONFIG_FILE
    from dspark_jax.spec.dspark.config import DSparkConfig

    try:
        trained = DSparkConfig.from_json(Path(draft_folder) / CONFIG_FILE).block_size
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"cannot read the drafter config in {draft_folder}: {e}") from None
    if block_size != trained:
        raise ValueError(f"--block-size {block_size} differs from the drafter's trained block size {trained}")
