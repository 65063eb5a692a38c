defmodule EMLXAxon.StreamTest do
  use ExUnit.Case, async: true

  alias EMLXAxon.{Error, Stream}

  test "new/1, info/1 and close/1" do
    %{default_device: default} = EMLXAxon.mlx_info()

    assert %Stream{device: ^default} = stream = Stream.new()
    assert {:ok, %{device: ^default, index: index, closed: false}} = Stream.info(stream)
    assert is_integer(index)

    assert %Stream{device: :cpu} = cpu = Stream.new(:cpu)
    assert {:ok, %{device: :cpu, closed: false}} = Stream.info(cpu)
    assert :ok = Stream.close(cpu)
    assert {:ok, %{closed: true}} = Stream.info(cpu)
    assert :ok = Stream.close(cpu)

    assert %Stream{} = Stream.new!(:cpu)
    assert {:ok, %Stream{device: :cpu}} = Stream.open(:cpu)
    assert {:ok, %Stream{device: ^default}} = Stream.open()
  end

  test "new/1 returns the stream itself, so it nests in with_stream/2" do
    result = Stream.with_stream(Stream.new(:cpu), fn -> Stream.current() end)
    assert %Stream{device: :cpu} = result
  end

  test "a GPU stream needs a GPU" do
    case EMLXAxon.mlx_info() do
      %{gpu_available: true} ->
        assert %Stream{device: :gpu} = Stream.new(:gpu)
        assert {:ok, %Stream{device: :gpu}} = Stream.open(:gpu)

      %{gpu_available: false} ->
        assert {:error, %Error{}} = Stream.open(:gpu)
        assert_raise Error, fn -> Stream.new(:gpu) end
    end
  end

  test "bad device" do
    assert_raise ArgumentError, ~r/:cpu, :gpu or :default/, fn -> Stream.new(:tpu) end
    assert_raise ArgumentError, ~r/:cpu, :gpu or :default/, fn -> Stream.open(:tpu) end
  end

  test "with_stream/2 sets and restores the process default" do
    first = Stream.new!(:cpu)
    second = Stream.new!(:cpu)
    assert Stream.current() == nil

    assert Stream.with_stream(first, fn ->
             assert Stream.current() == first
             Stream.with_stream(second, fn -> assert Stream.current() == second end)
             assert Stream.current() == first
             :result
           end) == :result

    assert Stream.current() == nil

    assert_raise RuntimeError, fn -> Stream.with_stream(first, fn -> raise "x" end) end
    assert Stream.current() == nil

    # Per process
    Stream.with_stream(first, fn ->
      assert Task.async(fn -> Stream.current() end) |> Task.await() == nil
    end)

    assert_raise ArgumentError, fn -> Stream.with_stream(:nope, fn -> :ok end) end
    assert_raise ArgumentError, fn -> Stream.with_stream(first, fn _ -> :ok end) end
  end
end
