"""src/kvhandoff/soak"""
