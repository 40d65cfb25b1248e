"""Reaching a host: transports (local, SSH), SSH options, deploy, the run client and control channel, the follow loop, the data source."""
