"""python -m tests.chaos.fake_aws --port 4566 --workdir /tmp/fake-aws [--moto-port 4567]"""

from tests.chaos.fake_aws.simulator import main

main()
