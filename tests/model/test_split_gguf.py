"""Split GGUF models (``model-00001-of-0000N.gguf``, as llama.cpp's gguf-split writes them): the reader, facts,
engine facts and ``hybrimoe info`` see the whole model through its first shard, llama.cpp loads it, and a broken
split is refused with the shard named. Oracle: the same model as one file."""
from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np
import pytest

from hybrimoe.commands import info as info_command
from hybrimoe.model import reader
from hybrimoe.model.facts import facts_from_gguf
from hybrimoe.tiny import make_tiny_model, split_gguf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    single = make_tiny_model(d / "one.gguf", "qwen3moe", n_layer=3)
    first = split_gguf(single, d / "many.gguf", 3)
    return single, first


def _no_paths(x: dict) -> dict:
    return {k: v for k, v in x.items() if k not in ("path", "file_size", "n_shards")}


def test_the_first_shard_describes_the_whole_model(pair):
    single, first = pair
    assert first.name == "many-00001-of-00003.gguf"
    a, b = reader.describe(single), reader.describe(first)
    assert b["n_shards"] == 3 and a["n_shards"] == 1
    assert _no_paths(a) == _no_paths(b)
    # every shard's bytes, and more than the first shard alone holds
    shards = [first.with_name(f"many-{i:05d}-of-00003.gguf") for i in (1, 2, 3)]
    assert b["file_size"] == sum(os.path.getsize(p) for p in shards) > os.path.getsize(first)
    g = reader.open_gguf(first)
    assert set(g.tensors) == set(reader.open_gguf(single).tensors)
    # each tensor's shard and offset point at its bytes
    for name, (path, off) in g.tensor_shard.items():
        t = g.tensors[name]
        with open(path, "rb") as f:
            f.seek(off)
            assert f.read(int(t.n_bytes)) == t.data.tobytes(), name


def test_facts_and_engine_facts_of_a_split_model_are_the_single_files(pair):
    from hybrimoe.runtime.engine_facts import engine_facts

    single, first = pair
    a, b = facts_from_gguf(single), facts_from_gguf(first)
    for f in dataclasses.fields(a):
        if f.name != "sources":
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    ea, eb = engine_facts(single), engine_facts(first)
    for f in dataclasses.fields(ea):
        k = f.name
        if k in ("path", "model"):
            continue
        va, vb = getattr(ea, k), getattr(eb, k)
        if isinstance(va, list) and va and isinstance(va[0], np.ndarray):
            assert all(np.array_equal(x, y) for x, y in zip(va, vb)), k
        else:
            assert va == vb, k


def test_info_says_how_many_shards(pair, capsys):
    _, first = pair
    ap = argparse.ArgumentParser()
    info_command.add_arguments(ap)
    capsys.readouterr()
    assert info_command.run(ap.parse_args([str(first)])) == 0
    assert "in 3 shards" in capsys.readouterr().out


def test_llama_cpp_loads_the_split_model_with_the_same_tokens_and_logits(pair):
    from hybrimoe import Llama
    from hybrimoe.testing.upstream import greedy_with_logits, prompt_tokens

    single, first = pair
    runs = []
    for path in (single, first):
        llm = Llama(str(path), n_ctx=256, seed=0, verbose=False, no_repack=True)
        try:
            tokens = prompt_tokens(llm, 16)
            runs.append(greedy_with_logits(llm, tokens, 8))
        finally:
            llm.close()
    assert runs[0][0] == runs[1][0]
    assert np.array_equal(runs[0][1], runs[1][1])


def _copy_split(first, dst_dir):
    import shutil

    out = []
    for i in (1, 2, 3):
        src = first.with_name(f"many-{i:05d}-of-00003.gguf")
        out.append(dst_dir / src.name)
        shutil.copy(src, out[-1])
    return out


def test_a_missing_shard_is_named(pair, tmp_path):
    _, first = pair
    shards = _copy_split(first, tmp_path)
    shards[2].unlink()
    with pytest.raises(FileNotFoundError, match="many-00003-of-00003.gguf.*shard 3 of 3"):
        reader.open_gguf(shards[0])


def test_a_truncated_shard_is_named(pair, tmp_path):
    _, first = pair
    shards = _copy_split(first, tmp_path)
    os.truncate(shards[1], os.path.getsize(shards[1]) - 100)
    with pytest.raises(ValueError, match="many-00002-of-00003.gguf: truncated"):
        reader.open_gguf(shards[0])


def test_a_later_shard_or_a_renamed_first_shard_is_refused(pair, tmp_path):
    _, first = pair
    shards = _copy_split(first, tmp_path)
    with pytest.raises(ValueError, match="shard 2 of a model split in 3 files; give the first shard"):
        reader.open_gguf(shards[1])
    renamed = tmp_path / "model.gguf"
    os.rename(shards[0], renamed)
    with pytest.raises(ValueError, match="does not end in '-00001-of-00003.gguf'"):
        reader.open_gguf(renamed)


def test_a_shard_of_another_split_is_refused(pair, tmp_path):
    single, first = pair
    shards = _copy_split(first, tmp_path)
    other = split_gguf(single, tmp_path / "other.gguf", 2)
    os.replace(other.with_name("other-00002-of-00002.gguf"), shards[1])
    with pytest.raises(ValueError, match="a shard of another split"):
        reader.open_gguf(shards[0])


def test_split_gguf_never_overwrites(pair, tmp_path):
    single, _ = pair
    split_gguf(single, tmp_path / "x.gguf", 2)
    before = (tmp_path / "x-00001-of-00002.gguf").read_bytes()
    with pytest.raises(ValueError, match="exists already"):
        split_gguf(single, tmp_path / "x.gguf", 2)
    assert (tmp_path / "x-00001-of-00002.gguf").read_bytes() == before


def test_trace_of_a_split_model_is_the_single_files(pair, tmp_path):
    import subprocess
    import sys

    single, first = pair
    out = []
    for i, path in enumerate((single, first)):
        dst = tmp_path / f"t{i}.npz"
        r = subprocess.run([sys.executable, "-m", "hybrimoe", "trace", "-m", str(path), "-p", "hello world", "-n", "6",
                            "-o", str(dst)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out.append(np.load(dst))
    for key in ("expert_ids", "router_scores", "expert_bytes", "moe_layer_ids"):
        assert np.array_equal(out[0][key], out[1][key]), key
