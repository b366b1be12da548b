"""The client's internals: not public API; they may change in any release.
The public modules and names are listed in docs/python-client.md
("Public API")."""
