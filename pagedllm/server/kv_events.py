"""KV-cache events published as vLLM publishes them (``--kv-events-config``), so routers that follow replicas' prefix
caches (vllm-router's ``kv_aware`` policy, llm-d's prefix-cache scorer) can follow pagedllm's.

Per engine step that changed the prefix cache, one ZMQ PUB message of three frames: the topic, a sequence number
(8 bytes, big-endian) and a msgpack ``KVEventBatch``: its time and events, vLLM's ``BlockStored`` (a full block
entered the cache: its hash, its parent's, its tokens) and ``BlockRemoved`` (a block's content was evicted), as
msgspec encodes vLLM's structs since vLLM 0.28 (the batch an array, each event a map tagged ``type``: the layout
vllm-router 0.1.17 decodes; the older array-like events it refuses). Block hashes are the prefix cache's chained sha256
digests (``core.block_pool.hash_block_tokens``).

With ``replay_endpoint``, a ZMQ ROUTER socket there answers a subscriber that saw a gap in the sequence numbers, as
vLLM's does: a request carrying a start sequence number (8 bytes, big-endian) gets each of the last ``buffer_steps``
batches from that number on as [sequence number, batch], then an end marker [-1 as 8 signed bytes, empty]."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque

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
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches (bound)
    buffer_steps: int = 10_000  # batches kept for replay

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """The config of ``--kv-events-config`` (None: no events); ValueError naming what is wrong."""
        if not text:
            return None
        tuning = {"max_queue_size"}  # vLLM's queue between its engine and publisher threads: none here
        d = json_object(text, "--kv-events-config", {f.name for f in dataclasses.fields(cls)} | tuning)
        cfg = cls(**{k: v for k, v in d.items() if k not in tuning})
        if not isinstance(cfg.buffer_steps, int) or cfg.buffer_steps < 1:
            raise ValueError(f"--kv-events-config: buffer_steps must be a positive integer, got {cfg.buffer_steps!r}")
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        return cfg if cfg.enable_kv_cache_events and cfg.publisher == "zmq" else None


class KVEventPublisher:
    """A stat logger (``AsyncLLM.stat_loggers``: ``record`` runs on the engine thread after each step) that sends
    the step's prefix-cache events, if any."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker

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
        # with a replay endpoint, (sequence number, batch) of the last buffer_steps batches: appended on the engine
        # thread, read by the replay thread (the only user of the ROUTER socket; ZMQ sockets are not shared between
        # threads)
        self._buffer: deque[tuple[int, bytes]] | None = deque(maxlen=cfg.buffer_steps) if cfg.replay_endpoint else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread = None
        if cfg.replay_endpoint:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.bind(cfg.replay_endpoint)
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(replay,), daemon=True,
                                                   name="kv-events-replay")
            self._replay_thread.start()

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
        if self._buffer is not None:
            with self._lock:  # kept for replay whether or not the live send went out
                self._buffer.append((self._seq, payload))
        self._seq += 1

    def _serve_replay(self, sock) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) < 2:
                    continue
                # [identity, start] from a DEALER, [identity, b"", start] from a REQ (which expects the empty
                # delimiter back)
                head = frames[:2] if len(frames) >= 3 and frames[1] == b"" else frames[:1]
                start = int.from_bytes(frames[-1][:8], "big")
                with self._lock:
                    items = [(seq, payload) for seq, payload in self._buffer if seq >= start]
                for seq, payload in items:
                    sock.send_multipart((*head, seq.to_bytes(8, "big"), payload))
                sock.send_multipart((*head, self.END_SEQ, b""))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        """Stops the replay thread and closes the socket; a second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()
