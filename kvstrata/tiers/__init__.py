"""kvstrata.tiers"""
