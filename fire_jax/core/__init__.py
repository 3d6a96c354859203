"""The foundations every layer stands on: config files and paths, the errors a job ends on, tile geometry, the JSONL
result store, how a command line ends, the machine's matmul rate.
"""
