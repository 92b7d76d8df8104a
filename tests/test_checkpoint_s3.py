"""Checkpoints mirrored to S3, against a local moto server started here (dummy credentials,
never real AWS). Between boto3 and moto sits a small HTTP proxy that answers some requests with
503 Slow Down, as S3 does under load, so the retries and backoff run for real."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tasks.configs import TrainConfig, from_dict, tiny, to_dict
from tasks.model.gpt import GPT
from tasks.train import checkpoint as ckpt
from tasks.train.prepared_data import DataDir, PretrainBatches
from tasks.train.losses import cross_entropy
from tasks.train.loop import LoopOptions, train
from tasks.train.runtime import seed_everything
from tasks.train.checkpoint_s3 import S3Mirror
from tasks.train.scoring import shard_loss

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlowDownProxy(ThreadingHTTPServer):
    """Forwards every request to moto, except that it answers 503 Slow Down to the first
    `budget[kind]` requests of each kind (upload_part, put_manifest, get)."""

    daemon_threads = True

    def __init__(self, upstream: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = upstream
        self.budget = {"upload_part": 0, "put_manifest": 0, "get": 0}
        self.refused: list[str] = []
        self.lock = threading.Lock()

    def should_refuse(self, method: str, path: str) -> str | None:
        kind = None
        if method == "PUT" and "partNumber=" in path:
            kind = "upload_part"
        elif method == "PUT" and path.split("?")[0].endswith("manifest.json"):
            kind = "put_manifest"
        elif method == "GET" and "list-type" not in path and "uploads" not in path:
            kind = "get"
        with self.lock:
            if kind and self.budget[kind] > 0:
                self.budget[kind] -= 1
                self.refused.append(f"{method} {path}")
                return kind
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        body = self._body()
        if self.server.should_refuse(self.command, self.path):
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOW_DOWN)))
            self.end_headers()
            self.wfile.write(SLOW_DOWN)
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.server.upstream, timeout=30)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("transfer-encoding", "content-length")}
        headers["Content-Length"] = str(len(body))
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        # a HEAD answer has no body but states the object's length
        length = resp.getheader("Content-Length") if self.command == "HEAD" else len(data)
        self.send_header("Content-Length", str(length or 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 and the Slow Down proxy in front of it; boto3 is pointed at
    the proxy with dummy credentials."""
    port = free_port()
    moto = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or moto.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        proxy = SlowDownProxy(port)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{proxy.server_port}",
               "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        import boto3

        boto3.client("s3").create_bucket(Bucket="ckpts")
        yield proxy
    finally:
        if "proxy" in locals():
            proxy.shutdown()
            proxy.server_close()
        if "old" in locals():
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        moto.terminate()
        moto.wait(10)


def test_checkpoints_round_trip_through_s3_with_multipart_and_slow_down(s3, tmp_path):
    mirror = S3Mirror("s3://ckpts/run-1/checkpoints", part_size=5 << 20, base_delay=0.01)
    saver = ckpt.Checkpointer(tmp_path / "local", keep=2, config={"run": 1}, mirror=mirror)
    big = torch.arange(3_000_000, dtype=torch.float32)  # 12 MB: a 3-part multipart upload
    s3.budget.update(upload_part=2, put_manifest=1)
    for step in (1, 2, 3):
        saver.save(step, {"model": {"w": big + step}, "trainer": {"step": step, "data_cursor": step}})
    saver.wait()
    assert len(s3.refused) == 3 and mirror.retries == 3  # every Slow Down was retried
    assert mirror.steps() == [3, 2]  # keep=2 holds on S3 as on disk
    client = mirror.client
    assert not client.list_multipart_uploads(Bucket="ckpts").get("Uploads")  # none left open
    size = client.head_object(Bucket="ckpts", Key="run-1/checkpoints/step_000003/model.pt")
    assert size["ContentLength"] > 12_000_000

    # a new node: nothing on local disk, so resume downloads the newest step and verifies it
    fresh = ckpt.Checkpointer(tmp_path / "node2", keep=2, config={}, mirror=mirror)
    s3.budget.update(get=1)
    path = fresh.find_resume()
    assert path == tmp_path / "node2" / "step_000003"
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["w"], big + 3)

    # S3's copy of step 3 damaged and the local copy gone: step 2 is used instead
    client.put_object(Bucket="ckpts", Key="run-1/checkpoints/step_000003/model.pt", Body=b"junk")
    fresh2 = ckpt.Checkpointer(tmp_path / "node3", keep=2, config={}, mirror=mirror)
    assert fresh2.find_resume() == tmp_path / "node3" / "step_000002"
    assert not list((tmp_path / "node3").glob(".tmp-*"))  # the bad download was cleaned up

    # a committed step is only one with its manifest: an upload cut short is never a checkpoint
    client.put_object(Bucket="ckpts", Key="run-1/checkpoints/step_000009/model.pt", Body=b"half")
    assert mirror.steps() == [3, 2]


def test_training_resumes_from_s3_after_the_local_disk_is_lost(s3, tiny_data_dir, tmp_path):
    """A job checkpoints to S3, its machine is replaced (the local checkpoints are gone), the
    retry resumes from S3 and ends bitwise where the uninterrupted job does."""
    data = DataDir(tiny_data_dir)

    def run(output_dir: Path, max_steps: int, mirror: S3Mirror | None):
        base = tiny().pretrain
        cfg = from_dict(TrainConfig, {**to_dict(base), "data_dir": str(tiny_data_dir),
                                      "output_dir": str(output_dir), "max_steps": max_steps,
                                      "checkpoint_interval": 5,
                                      "optim": {**to_dict(base.optim), "min_lr_ratio": 1.0}})
        seed_everything(cfg.seed)
        model = GPT(cfg.model)
        val = data.split("val")
        result = train(model=model, cfg=cfg, device=torch.device("cpu"), resolved_config=to_dict(cfg),
                       get_batch=PretrainBatches(data.split("train"), cfg.batch_size, cfg.seed),
                       loss_fn=cross_entropy, tracking=False,
                       evaluate=lambda m: {"val_loss": shard_loss(m, val, 4, 1, torch.device("cpu"))},
                       options=LoopOptions(checkpoint_mirror=mirror))
        return model, result

    whole, _ = run(tmp_path / "whole", 15, None)
    mirror = S3Mirror("s3://ckpts/run-2/checkpoints", base_delay=0.01)
    _, first = run(tmp_path / "job", 10, mirror)
    assert first.checkpoint.endswith("step_000010") and mirror.steps() == [10, 5]
    import shutil

    shutil.rmtree(tmp_path / "job" / "checkpoints")  # the node is gone
    resumed, second = run(tmp_path / "job", 15, mirror)
    assert second.resumed_from == str(tmp_path / "job" / "checkpoints" / "step_000010")
    sa, sb = resumed.state_dict(), whole.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_every_object_a_job_writes_carries_the_kms_key(s3, tmp_path, monkeypatch):
    """A bucket policy may refuse any PutObject without SSE-KMS: with the backend's key in
    LLMOPS_S3_KMS_KEY_ID, the checkpoint mirror (single and multipart uploads) and the job's
    entry (outputs, result) write every object with aws:kms and that key."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docker"))
    import job_entry

    key_id = "arn:aws:kms:us-east-1:123456789012:key/llmops-test"
    monkeypatch.setenv("LLMOPS_S3_KMS_KEY_ID", key_id)
    mirror = S3Mirror("s3://ckpts/kms/checkpoints", part_size=5 << 20, base_delay=0.01)
    saver = ckpt.Checkpointer(tmp_path / "local", keep=2, config={}, mirror=mirror)
    saver.save(1, {"model": {"w": torch.arange(2_000_000, dtype=torch.float32)},   # 8 MB: multipart
                   "trainer": {"step": 1, "data_cursor": 1}})
    saver.wait()
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}")
    job_entry.upload(out, "s3://ckpts/kms/output")
    job_entry.write_text("s3://ckpts/kms/result.json", "{}")
    client = mirror.client
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="ckpts", Prefix="kms/")["Contents"]]
    assert {"kms/checkpoints/step_000001/model.pt", "kms/checkpoints/step_000001/manifest.json",
            "kms/output/model/config.json", "kms/result.json"} <= set(keys)
    for key in keys:
        head = client.head_object(Bucket="ckpts", Key=key)
        assert head.get("ServerSideEncryption") == "aws:kms", key
        assert head.get("SSEKMSKeyId") == key_id, key


def test_a_sharded_restore_fetches_the_shared_files_then_each_rank_only_its_own_shards(s3, tmp_path):
    """An FSDP job on a fresh node restores a sharded checkpoint from S3 without fetching every
    rank's shards: rank 0's choice fetches the files every rank reads (manifest, DCP's index,
    trainer state, config), and each rank's load fetches the shard files its own DCP load plan
    reads, verified before they appear. Here the checkpoint holds this rank's shard and another
    rank's (__1_0.distcp, which this rank's plan does not read): the fresh node never fetches the
    other one. A shard whose S3 copy is damaged is refused, and no file is left under its name."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tasks.train.checkpoint_io import save_tensor_file
    from tasks.train.distributed import _fetching_reader

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        weights = torch.arange(1000, dtype=torch.float32)
        tmp = tmp_path / "local" / ".tmp-step_000005-sharded"
        dcp.save({"model": {"w": weights}}, checkpoint_id=str(tmp))
        (tmp / "__1_0.distcp").write_bytes(os.urandom(4096))   # another rank's part
        save_tensor_file({"step": 5, "data_cursor": 5}, tmp / "trainer.pt")
        files = {f.name: ckpt._file_entry(f) for f in tmp.iterdir()}
        saved = ckpt._commit(tmp, tmp_path / "local" / "step_000005", 5, files, {}, keep=2,
                             layout=ckpt.SHARDED)
        mirror = S3Mirror("s3://ckpts/run-sharded/checkpoints", base_delay=0.01)
        mirror.upload_checkpoint(saved)

        fresh = ckpt.Checkpointer(tmp_path / "node2", keep=2, config={}, mirror=mirror)
        fresh.shard_with(dist.group.WORLD, 0)
        path = fresh.find_resume()
        assert path == tmp_path / "node2" / "step_000005"
        assert sorted(p.name for p in path.iterdir()) == [".metadata", "config.json", "manifest.json",
                                                          "trainer.pt"]
        assert fresh.ensure_local(path) == path   # another rank of this node: nothing more to fetch
        state = {"model": {"w": torch.zeros(1000)}}
        dcp.load(state, storage_reader=_fetching_reader(path, lambda names: fresh.fetch_files(path, names)))
        assert torch.equal(state["model"]["w"], weights)
        assert (path / "__0_0.distcp").is_file() and not (path / "__1_0.distcp").exists()

        mirror.client.put_object(Bucket="ckpts", Key="run-sharded/checkpoints/step_000005/__0_0.distcp",
                                 Body=b"damaged")
        third = ckpt.Checkpointer(tmp_path / "node3", keep=2, config={}, mirror=mirror)
        third.shard_with(dist.group.WORLD, 0)
        path = third.find_resume()
        with pytest.raises(ValueError, match="does not match its manifest"):
            third.fetch_files(path, ["__0_0.distcp"])
        assert sorted(p.name for p in path.iterdir()) == [".metadata", "config.json", "manifest.json",
                                                          "trainer.pt"]
    finally:
        dist.destroy_process_group()
