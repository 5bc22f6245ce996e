"""Stand-in for RL-Align/vime's package layout at commit 33254c738f1d43250916ae6887f7981e77dbe411
(see tests/host_stubs/README.md): only the `--linear-logp-provider` boundary module."""
