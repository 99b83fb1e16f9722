"""kvstrata.cli"""
