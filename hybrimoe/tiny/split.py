"""Split a GGUF model into shards, as llama.cpp's gguf-split does (``--split-max-tensors``): the tests' stand-in
for the split files every large model ships as (``model-00001-of-00005.gguf``)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import gguf


def split_gguf(src, dst, n_shards: int) -> Path:
    """Write GGUF ``src`` as ``n_shards`` shard files named after ``dst`` (``dst`` ``m.gguf`` gives
    ``m-00001-of-0000N.gguf``, ...; llama.cpp's naming, llama_split_path) and return the first shard's path.

    The first shard holds the metadata (every key of ``src``, plus ``split.no``, ``split.count`` and
    ``split.tensors.count`` in each shard, as gguf-split writes them); the tensors keep their order, about
    ``len(tensors) / n_shards`` per shard, with the bytes of ``src`` (quantized blocks copied as they are).

    Raises:
        ValueError: ``n_shards`` < 2 or more than the tensors; ``src`` is itself a shard; a shard file exists
            already (nothing is overwritten).
    """
    r = gguf.GGUFReader(str(src))
    if r.fields.get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT) is not None:
        raise ValueError(f"{src}: already a shard of a split model")
    n = len(r.tensors)
    if not 2 <= int(n_shards) <= n:
        raise ValueError(f"n_shards must be between 2 and the {n} tensors of {src}, got {n_shards}")
    dst = Path(os.fspath(dst))
    names = [dst.with_name(gguf.gguf_writer.SHARD_NAME_FORMAT.format(dst.stem, i + 1, n_shards))
             for i in range(n_shards)]
    for p in names:
        if p.exists():
            raise ValueError(f"{p} exists already; not overwriting it")
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch, split_max_tensors=math.ceil(n / n_shards))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.startswith("split."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=gguf.GGMLQuantizationType(int(t.tensor_type)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if not names[0].exists() or len(w.tensors) != n_shards:
        raise RuntimeError(f"gguf's writer wrote {len(w.tensors)} shards, not {n_shards}")
    return names[0]
