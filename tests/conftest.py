pytest_plugins = ["tests.fixtures_models", "tests.ssh_fixtures"]
