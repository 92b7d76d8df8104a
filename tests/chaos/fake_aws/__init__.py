"""AWS that fails (being split into one module per concern): everything is in simulator.py for now."""

from tests.chaos.fake_aws.simulator import (BATCH_CAPACITY, BATCH_GROUP, CREDENTIALS, SM_CAPACITY, SM_GROUP,
                                            ChaosClient, FakeAws)

__all__ = ["BATCH_CAPACITY", "BATCH_GROUP", "CREDENTIALS", "SM_CAPACITY", "SM_GROUP", "ChaosClient", "FakeAws"]
