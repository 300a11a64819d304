"""KV-cache events published as vLLM publishes them (``--kv-events-config``), so routers that follow replicas' prefix
caches (vllm-router's ``kv_aware`` policy, llm-d's prefix-cache scorer) can follow pagedllm's.

Per engine step that changed the prefix cache, one ZMQ PUB message of three frames: the topic, a sequence number
(8 bytes, big-endian) and a msgpack ``KVEventBatch``: its time and events, vLLM's ``BlockStored`` (a full block
entered the cache: its hash, its parent's, its tokens) and ``BlockRemoved`` (a block's content was evicted), as
msgspec encodes vLLM's structs since vLLM 0.28 (the batch an array, each event a map tagged ``type``: the layout
vllm-router 0.1.17 decodes; the older array-like events it refuses). Block hashes are the prefix cache's chained sha256
digests (``core.block_pool.hash_block_tokens``)."""

from __future__ import annotations

import dataclasses
import time

import msgspec
import zmq

from pagedllm.config import json_object
from pagedllm.outputs import IterationStats, KVBlockRemoved, KVBlockStored, SchedulerStats


# the wire format: vLLM's KV-event structs (vllm/distributed/kv_events.py)
class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class KVEventBatch(_EventBatch):
    events: list[BlockStored | BlockRemoved]


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` fields that pagedllm implements (a JSON object)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null" (none)
    endpoint: str = "tcp://*:5557"  # bound where it has a wildcard (or is ipc:// / inproc://), else connected to
    topic: str = ""
    hwm: int = 100_000  # messages queued per subscriber before ZMQ drops them

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """The config of ``--kv-events-config`` (None: no events); ValueError naming what is wrong."""
        if not text:
            return None
        tuning = {"buffer_steps", "max_queue_size"}  # vLLM's replay buffer and queue sizes: nothing to size here
        d = json_object(text, "--kv-events-config", {f.name for f in dataclasses.fields(cls)} | tuning
                        | {"replay_endpoint"})
        if d.get("replay_endpoint") is not None:
            raise ValueError("--kv-events-config: replay_endpoint is not supported (subscribers see every step "
                             "from when they connect; a gap in the sequence numbers means dropped messages)")
        cfg = cls(**{k: v for k, v in d.items() if k not in tuning | {"replay_endpoint"}})
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        return cfg if cfg.enable_kv_cache_events and cfg.publisher == "zmq" else None


class KVEventPublisher:
    """A stat logger (``AsyncLLM.stat_loggers``: ``record`` runs on the engine thread after each step) that sends
    the step's prefix-cache events, if any."""

    def __init__(self, cfg: KVEventsConfig, block_size: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, cfg.hwm)
        ep = cfg.endpoint
        if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
            self._sock.bind(ep)
        else:
            self._sock.connect(ep)
        self._topic = cfg.topic.encode()
        self._block_size = block_size
        self._seq = 0

    def record(self, s: SchedulerStats, it: IterationStats) -> None:
        if not it.kv_events:
            return
        events = [BlockStored([e.block_hash], e.parent_hash, list(e.token_ids), self._block_size, None, None, None)
                  if isinstance(e, KVBlockStored) else BlockRemoved([e.block_hash], None)
                  for e in it.kv_events if isinstance(e, (KVBlockStored, KVBlockRemoved))]
        payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))
        try:  # never block the engine: a full queue drops the message (its sequence number shows the gap)
            self._sock.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        self._seq += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
