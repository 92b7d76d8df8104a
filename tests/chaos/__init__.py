"""AWS that fails: a fault-injecting proxy and job simulator in front of moto (see fake_aws/)."""
