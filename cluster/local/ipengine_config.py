# Engine settings for the "local" profile. torch threads and the rank are set by
# dtlab when it joins each engine to the torch.distributed world.
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile
