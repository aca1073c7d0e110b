"""The live tier: real ``p2pd`` daemons, DHTs, node processes and swarms on 127.0.0.1."""
