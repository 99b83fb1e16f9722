"""kvstrata.testing"""
