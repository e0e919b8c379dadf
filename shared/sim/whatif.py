"""placeholder"""
class WhatIf:
    @classmethod
    def for_cluster(cls, cluster, snapshot, cfg):
        return None
