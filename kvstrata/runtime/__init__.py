"""kvstrata.runtime"""
