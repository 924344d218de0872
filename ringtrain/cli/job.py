"""What `ringtrain train` trains: the task's datasets, model, loss, metrics, and the export.

    build_job(opts)     -> train/eval sets, GPT factory, loss, eval metrics, sample function
    export_final(...)   -> RUN_DIR/model.safetensors + model_config.json (rank 0, at the end)

`--data DIR` (a `ringtrain prepare` directory) is memory-mapped; `--data FILE.txt` is prepared
at char level into RUN_DIR/data first (`ringtrain.data.tokens.prepare_text_in`), so both train
the same way. Without --data it is the embedded addition task.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringtrain.cli.options import TrainOptions


def text_dataset_dir(opts: TrainOptions) -> str:
    """The prepared directory `--data` names, preparing a .txt into the run directory (its
    characters kept where a run there is to be resumed)."""
    if os.path.isdir(opts.data.data):
        return opts.data.data
    from ringtrain.cli.run_dir_setup import has_snapshot
    from ringtrain.data.tokens import prepare_text_in

    run = opts.run
    return prepare_text_in(opts.data.data, run.run_dir,
                           keep_chars=run.resume and has_snapshot(run.run_dir))


def check_text_data(path: str, block_size: int, warnings: list[str]) -> tuple[int, int]:
    """(training windows, tokens in the vocabulary) of `--data` (a prepared directory or a
    text), or a ValueError that says what is wrong (missing, not UTF-8, too short) before any
    worker starts; adds warnings."""
    from ringtrain.cli.dir_contents import holds

    if (kind := holds(path)) not in (None, "a prepared dataset"):  # a model, not data
        raise ValueError(f"--data {path} holds {kind}, not a dataset: --init-from {path} starts "
                         "from its model; --data takes a prepared dataset (ringtrain prepare) "
                         "or a .txt file")
    if os.path.isdir(path):
        from ringtrain.data.tokens import check_tokens, train_windows

        meta = check_tokens(path, block_size)
        return train_windows(meta, block_size), int(meta["vocab_size"])
    from ringtrain.data.chars import read_text, text_warnings, train_windows

    text = read_text(path, block_size)
    warnings += text_warnings(path, text)
    return train_windows(len(text), block_size), len(set(text))  # as prepare_text_in's


def build_job(opts: TrainOptions) -> dict[str, Any]:
    """Datasets, model factory, loss, eval metrics and sample function for the chosen task."""
    from ringtrain.models import GPTConfig, loss_fn

    tokenizer: dict[str, Any] | None = None
    d, m = opts.data, opts.model
    if d.data:
        from ringtrain.data.tokens import load_tokens, sample_tokens
        from ringtrain.errors import ConfigError

        try:  # checked before launch; a file changed since is said once, like any mistake
            data = load_tokens(text_dataset_dir(opts), d.block_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        train_set, eval_set, vocab, block = (data.train_set, data.eval_set, data.vocab_size,
                                             d.block_size)
        metrics: dict[str, Any] = {}
        tokenizer = {"dir": os.path.abspath(data.path), "meta": data.meta}

        def sample_fn(model):
            return sample_tokens(model, data, opts.run.sample_length, seed=opts.trainer.seed)
    else:
        from ringtrain.data.addition import AdditionDataset, exact_match, show_sums

        train_set, eval_set = AdditionDataset("train", d.digits), AdditionDataset("test", d.digits)
        vocab, block, metrics = (train_set.vocab_size, train_set.block_size,
                                 {"accuracy": exact_match})

        def sample_fn(model):
            return show_sums(model, eval_set)
    model_config = GPTConfig(vocab_size=m.vocab_rows(vocab), block_size=block, n_layer=m.n_layer,
                             n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout,
                             tie_embeddings=m.tie_embeddings, bias=m.bias,
                             activation_checkpointing=m.activation_checkpointing)
    return {"train_set": train_set, "eval_set": eval_set, "loss_fn": loss_fn,
            "eval_metrics": metrics, "sample_fn": sample_fn, "model_config": model_config,
            "model_fn": _model_fn(model_config, opts.run.init_from, tokenizer, vocab),
            "tokenizer": tokenizer}


def _model_fn(model_config, init_from: str | None, tokenizer: dict[str, Any] | None,
              tokens: int):
    """GPT(model_config), holding the weights of `init_from` where given (each call reads
    them: every rank builds its own model). The shape is checked here, once, before any rank
    builds one: the data fixes vocab_size (its `tokens`, padded) and block_size, which the
    launcher did not know; and the tokenizer the model records, against the data's ({"dir",
    "meta"}; None: digits)."""
    from ringtrain.models import GPT

    if init_from is None:
        return lambda: GPT(model_config)
    from dataclasses import asdict

    from ringtrain.cli.options import every_option_class
    from ringtrain.config import to_flags
    from ringtrain.errors import ConfigError
    from ringtrain.formats.init_from import check_shape, load_into, source_config, with_rows
    from ringtrain.formats.tokenizer import data_tokenizer, difference, read_tokenizer

    # The tokenizer first: where it differs, so does vocab_size, which no flag sets.
    source = read_tokenizer(init_from)
    why = difference(source, data_tokenizer(tokenizer)) if source else None
    if why:
        raise ConfigError(
            f"--init-from {init_from}: {why}; its token ids would mean other text here. "
            f"Tokenize the text with the model's tokenizer (ringtrain prepare SRC OUT_DIR "
            f"--tokenizer-from {init_from}, then --data OUT_DIR), or drop --init-from")
    shape = source_config(init_from)
    if shape and shape.vocab_size < tokens:
        raise ConfigError(
            f"--init-from {init_from}: its model has {shape.vocab_size} vocabulary rows, fewer "
            f"than the data's {tokens} tokens: the data was tokenized otherwise. Tokenize the "
            f"text with the model's tokenizer (ringtrain prepare SRC OUT_DIR --tokenizer-from "
            f"{init_from}), or drop --init-from")
    try:  # another padding of the same tokens (--pad-vocab) is not another shape
        check_shape(with_rows(shape, model_config.vocab_size, tokens), asdict(model_config),
                    init_from)
    except ValueError as e:  # "n_layer=12" -> "--n-layer 12"
        raise ConfigError(to_flags(str(e), every_option_class())) from None
    return lambda: load_into(GPT(model_config), init_from, tokens)


def export_final(model, job: dict[str, Any], run_dir: str) -> None:
    """RUN_DIR/model.safetensors + model_config.json from rank 0's final model.

    A failed write (a full disk) is a warning: the run itself succeeded and summary.json says so.
    """
    import logging

    from ringtrain.models.export import export_model

    try:
        export_model(model, run_dir, tokenizer=job["tokenizer"])
    except OSError as e:
        logging.getLogger("ringtrain").warning(
            "warning: the final model was not exported to %s (%s); its snapshots still hold it",
            run_dir, e.strerror or e)
