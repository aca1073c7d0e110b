"""What crosses the wire and the decisions peers must make alike.

Pure and deterministic: records validate when built or decoded, and rules are functions
of a swarm view and a seed. No networking code lives here.
"""
