"""python -m tests.chaos.fake_aws --port 4566 --workdir /tmp/fake-aws [--moto-port 4567]: moto, the
proxy and the simulator in this process until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

import tests.chaos.fake_aws as package
from tests.chaos.fake_aws.proxy import FakeAws


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.fake_aws", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the proxy's port on 127.0.0.1")
    parser.add_argument("--workdir", required=True, help="where the jobs' /opt/ml layouts and logs go")
    parser.add_argument("--moto-port", type=int, default=None, help="moto's port (default: a free one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    fake = FakeAws(args.port, args.workdir, args.moto_port).start()
    print(json.dumps({"url": fake.url, "moto": fake.moto_url, "connection": fake.connection()}), flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1):
        pass
    fake.stop()


if __name__ == "__main__":
    main()
